"""`run`: federated rounds over procs of simulated clients and edge clients over HTTP.

The controller holds the global model as one flat float32 vector. Each round it samples
clients (the strategy), sends each proc one message for all the clients it hosts and each edge
client its own, waits at most `timeout_s` per step, and applies the strategy's step to the mean
update. A client that raises, is not started within the step's time, or sends an answer that
fails its checks is dropped from the round with the reason recorded; a proc that dies or does
not answer drops all its clients for that round and is replaced before the next. A round with
fewer than `min_clients` updates is not applied.

With secure aggregation, each client masks (its update times its example count, then the
count) and the controller only ever holds masked vectors and their exact sum; dropped clients'
masks are removed from the survivors' shares (raymesh.federated.secagg). With DP, clients clip
their updates, every update counts once, and the controller adds Gaussian noise to the sum
before dividing by the number sampled (DP-FedAvg); Opacus's accountant gives epsilon per round.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raymesh.actor import host_mesh
from raymesh.federated.client import Layout
from raymesh.federated.host import HostProc, spawn_host
from raymesh.federated.privacy import DP, PrivacyAccountant
from raymesh.federated.protocol import (
    FIXED,
    Advertise,
    Adverts,
    Combine,
    Fit,
    Fitted,
    Message,
    Shares,
    ShareSeeds,
    Unmask,
    Unmasked,
)
from raymesh.federated.secagg import (
    SecAggError,
    SecAggServer,
    combine,
    default_degree,
    neighbours,
)
from raymesh.federated.server import BadUpdate, EdgeConfig, EdgeServer
from raymesh.federated.strategy import Strategy, Update

__all__ = ["Federation", "Result", "RoundRecord", "RunConfig", "run"]

logger = logging.getLogger("raymesh.federated")

SPAWN_TIMEOUT_S = 120.0


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How a federated run is laid out. `clients`: simulated clients, ids 0..clients-1 (edge
    clients get the ids after); `hosts`: procs carrying them (default: one per free CPU, at
    most 8); `keep_clients`: clients a proc keeps built; `timeout_s`: the most one step of a
    round waits; `degree`: secure aggregation's neighbours per client (default O(log n))."""

    clients: int
    rounds: int
    secure_aggregation: bool = False
    dp: DP | None = None
    hosts: int | None = None
    cpus_per_host: float = 1.0
    keep_clients: int = 512
    timeout_s: float = 60.0
    degree: int | None = None
    seed: int = 0
    edge: EdgeConfig | None = None

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ValueError:
            return ValueError(f"{name}={getattr(self, name)!r}: {fix}")

        if not isinstance(self.clients, int) or self.clients < 0:
            raise bad("clients", "give the number of simulated clients, an integer >= 0")
        if self.clients == 0 and (self.edge is None or self.edge.wait_for == 0):
            raise bad("clients", "give simulated clients, or edge clients to wait for")
        if not isinstance(self.rounds, int) or self.rounds < 1:
            raise bad("rounds", "give an integer >= 1")
        if self.hosts is not None and (not isinstance(self.hosts, int) or self.hosts < 1):
            raise bad("hosts", "give a number of procs >= 1, or None for one per free CPU")
        if not self.cpus_per_host > 0:
            raise bad("cpus_per_host", "give CPUs per proc, > 0 (0.5 packs two on a core)")
        if not isinstance(self.keep_clients, int) or self.keep_clients < 1:
            raise bad("keep_clients", "give an integer >= 1")
        if not self.timeout_s > 0:
            raise bad("timeout_s", "give seconds > 0")
        if self.degree is not None and (not isinstance(self.degree, int) or self.degree < 2):
            raise bad("degree", "give an even neighbour count >= 2, or None for O(log n)")
        if self.dp is not None and not isinstance(self.dp, DP):
            raise bad("dp", "give raymesh.federated.DP(clip=..., noise_multiplier=...)")


@dataclass(frozen=True)
class RoundRecord:
    """What one round did. `dropped[cid]` says why a sampled client is not in the update;
    `metrics` are the evaluation's and the clients' mean figures ("loss")."""

    round: int
    sampled: int
    responded: int
    dropped: dict[int, str]
    applied: bool
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    epsilon: float | None = None
    replaced_hosts: int = 0
    reason: str = ""


@dataclass
class Result:
    history: list[RoundRecord]
    epsilon: float | None
    layout: Layout
    weights: np.ndarray
    template: dict[str, torch.Tensor]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final global model, in the template model's state_dict form."""
        return _state_dict(self.layout, self.weights, self.template)


def _state_dict(
    layout: Layout, weights: np.ndarray, template: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    out = {k: v.clone() for k, v in template.items()}
    for name, value in layout.unflatten(weights).items():
        out[name] = torch.from_numpy(value.copy()).to(out[name].dtype)
    return out


class _Edge:
    """One edge client as a round target."""

    def __init__(self, server: EdgeServer, cid: int) -> None:
        self.server, self.cid = server, cid

    def send(self, msg: Message, check: Callable[[Any], None]) -> Any:
        return self.server.send(self.cid, msg, check)

    def __repr__(self) -> str:
        return f"edge client {self.cid}"


Target = HostProc | _Edge


class _Checks:
    """What a valid answer to each step looks like; a failure raises BadUpdate(reason)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __call__(self, msg: Message, clients: Sequence[int], reply: Any) -> None:
        expected = {Advertise: Adverts, ShareSeeds: Shares, Fit: Fitted, Unmask: Unmasked}
        if not isinstance(reply, expected[type(msg)]):
            raise BadUpdate(f"answered {type(msg).__name__} with {type(reply).__name__}")
        mine = set(clients)
        if isinstance(reply, Adverts):
            for a in reply.adverts:
                if a.client not in mine or len(a.c_public) != 32 or len(a.s_public) != 32:
                    raise BadUpdate(f"a key advert for client {a.client} is not valid")
        elif isinstance(reply, Shares):
            if not set(reply.outgoing) <= mine:
                raise BadUpdate("shares sent for clients it does not hold")
        elif isinstance(reply, Fitted):
            self._fitted(msg, mine, reply)
        elif isinstance(reply, Unmasked) and not set(reply.answers) <= mine:
            raise BadUpdate("shares revealed for clients it does not hold")

    def _fitted(self, msg: Message, mine: set[int], reply: Fitted) -> None:
        assert isinstance(msg, Fit)
        if reply.round != msg.round:
            raise BadUpdate(f"an update for round {reply.round}, not {msg.round}")
        if not set(reply.examples) <= mine:
            raise BadUpdate("updates for clients it does not hold")
        for c, n in reply.examples.items():
            if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0:
                raise BadUpdate(f"client {c}: num_examples={n!r} is not an int > 0")
        if msg.secure:
            m = reply.masked
            if not isinstance(m, np.ndarray) or m.dtype != np.uint64 or m.shape != (self.size + 1,):
                got = f"{m.dtype}{list(m.shape)}" if isinstance(m, np.ndarray) else type(m).__name__
                raise BadUpdate(f"masked update is {got}, not uint64[{self.size + 1}]")
            return
        if set(reply.deltas) != set(reply.examples):
            raise BadUpdate("an update count does not match the updates")
        for c, d in reply.deltas.items():
            if not isinstance(d, np.ndarray) or d.dtype != np.float32 or d.shape != (self.size,):
                got = f"{d.dtype}{list(d.shape)}" if isinstance(d, np.ndarray) else type(d).__name__
                raise BadUpdate(f"client {c}: update is {got}, not float32[{self.size}]")
            if not np.all(np.isfinite(d)):
                raise BadUpdate(f"client {c}: the update holds NaN or Inf values")


class Federation:
    """The procs, the edge server and the global model of one run; `run_round` is one round."""

    def __init__(
        self,
        client_fn: Callable[[int], Any],
        strategy: Strategy,
        config: RunConfig,
        evaluate_fn: Callable[[torch.nn.Module], Any] | None = None,
    ) -> None:
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy={strategy!r}: give a raymesh.federated strategy, e.g. FedAvg()"
            )
        self.client_fn, self.strategy, self.config = client_fn, strategy, config
        self.evaluate_fn = evaluate_fn
        self._model: torch.nn.Module = client_fn(0).model
        state = self._model.state_dict()
        self.template = {k: v.detach().clone() for k, v in state.items()}
        self.layout = Layout.of(state)
        self.weights = self.layout.flatten(state)
        self._check = _Checks(self.layout.size)
        self.accountant = PrivacyAccountant(config.dp) if config.dp else None
        self._noise = np.random.default_rng([config.seed, 7])
        self.hosts: list[HostProc] = []
        self._lost: set[int] = set()
        self.edge: EdgeServer | None = None
        try:
            if config.clients:
                n = config.hosts or self._default_hosts()
                with concurrent.futures.ThreadPoolExecutor(n) as pool:
                    self.hosts = list(pool.map(self._spawn, range(min(n, config.clients))))
            if config.edge is not None:
                self.edge = EdgeServer(config.edge, first_cid=config.clients)
                shown = "<your token>" if config.edge.token else self.edge.token
                logger.info(
                    "raymesh.federated: edge clients connect with `raymesh federated client "
                    "--server %s --token %s --client module:client_fn`",
                    self.edge.url,
                    shown,
                )
        except BaseException:
            self.stop()
            raise

    def _default_hosts(self) -> int:
        # The embedded local Ray counts 64 logical CPUs whatever the cores, so count cores too.
        free = host_mesh().free_procs(cpus_per_proc=self.config.cpus_per_host)
        return max(1, min(8, os.cpu_count() or 1, sum(free.values())))

    def _spawn(self, index: int) -> HostProc:
        return spawn_host(
            index,
            self.client_fn,
            keep=self.config.keep_clients,
            cpus=self.config.cpus_per_host,
            timeout=SPAWN_TIMEOUT_S,
        )

    def stop(self) -> None:
        if self.edge is not None:
            self.edge.finish("the run is over")
        for h in self.hosts:
            h.stop()

    # --- one round -----------------------------------------------------------------------

    def population(self) -> list[int]:
        return list(range(self.config.clients)) + (self.edge.clients() if self.edge else [])

    def _assign(self, sampled: Sequence[int]) -> dict[Target, list[int]]:
        """The round's clients by where they train: each edge client on its device; the
        simulated ones spread evenly over the procs, each on its home proc (cid mod procs,
        where it is likely built already) unless that proc has its share, then on the least
        loaded. A round's time is its slowest proc's, so balance beats stickiness."""
        groups: dict[Target, list[int]] = {}
        simulated = [c for c in sampled if c < self.config.clients]
        for c in sampled:
            if c >= self.config.clients:
                assert self.edge is not None
                groups[_Edge(self.edge, c)] = [c]
        if not simulated:
            return groups
        n = len(self.hosts)
        share = -(-len(simulated) // n)
        load: list[list[int]] = [[] for _ in range(n)]
        overflow: list[int] = []
        for c in simulated:
            home = load[c % n]
            (home if len(home) < share else overflow).append(c)
        for c in overflow:
            min(load, key=len).append(c)
        groups.update({self.hosts[i]: cs for i, cs in enumerate(load) if cs})
        return groups

    def _exchange(
        self, msgs: Mapping[Target, tuple[Message, Sequence[int]]], dropped: dict[int, str]
    ) -> dict[Target, Any]:
        """Send each target its message; return the valid answers that came in time. A target
        that fails drops its clients (`dropped`); a failed proc is replaced after the round."""
        deadline = time.monotonic() + self.config.timeout_s
        sent = {}
        for t, (msg, clients) in msgs.items():
            check = self._bind(msg, clients)
            sent[t] = t.send(msg, check) if isinstance(t, _Edge) else t.send(msg)
        out = {}
        for t, waiting in sent.items():
            msg, clients = msgs[t]
            try:
                reply = waiting.get(timeout=max(0.0, deadline - time.monotonic()))
                if isinstance(t, HostProc):
                    self._check(msg, clients, reply)
                out[t] = reply
            except BadUpdate as e:
                reason = f"refused: {e}"
                logger.warning("raymesh.federated: %s: %s", t, reason)
                dropped.update(dict.fromkeys(clients, reason))
            except Exception as e:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if isinstance(t, HostProc):
                    reason = f"its proc failed ({reason})"
                    self._lost.add(t.index)
                logger.warning("raymesh.federated: %s: %s", t, reason)
                dropped.update(dict.fromkeys(clients, reason))
        return out

    def _bind(self, msg: Message, clients: Sequence[int]) -> Callable[[Any], None]:
        return lambda reply: self._check(msg, clients, reply)

    def run_round(self, r: int) -> RoundRecord:
        started = time.monotonic()
        population = self.population()
        sampled = self.strategy.sample(r, population, self.config.seed)
        dropped: dict[int, str] = {}
        groups = self._assign(sampled)
        config = self.strategy.client_config(r)
        if self.config.secure_aggregation:
            total, weight, fitted = self._secure(r, groups, config, dropped)
        else:
            total, weight, fitted = self._plain(r, groups, config, dropped)
        responded = sum(len(f.examples) for f in fitted)
        applied, reason = False, ""
        if responded < self.strategy.min_clients:
            reason = f"{responded} of {len(sampled)} clients answered, min_clients is "
            reason += f"{self.strategy.min_clients}: the round is not applied"
        elif total is not None:
            if self.config.dp is not None:
                assert self.accountant is not None
                total = total + self.accountant.noise(total.shape, self._noise)
                weight = float(len(sampled))
            mean = self.layout.unflatten((total / weight).astype(np.float32))
            current = self.layout.unflatten(self.weights)
            self.weights = self.layout.flatten(self.strategy.apply(current, mean))
            applied = True
        elif fitted:
            updates = [
                Update(c, self.layout.unflatten(f.deltas[c]), f.examples[c])
                for f in fitted
                for c in f.examples
            ]
            current = self.layout.unflatten(self.weights)
            self.weights = self.layout.flatten(self.strategy.aggregate(current, updates))
            applied = True
        if reason:
            logger.warning("raymesh.federated: round %d: %s", r, reason)
        epsilon = None
        if self.accountant is not None:
            epsilon = self.accountant.step(sample_rate=len(sampled) / max(1, len(population)))
        metrics = self._metrics(fitted)
        replaced = self._replace_lost()
        return RoundRecord(
            round=r,
            sampled=len(sampled),
            responded=responded,
            dropped=dropped,
            applied=applied,
            seconds=time.monotonic() - started,
            metrics=metrics,
            epsilon=epsilon,
            replaced_hosts=replaced,
            reason=reason,
        )

    def _fit(
        self, r: int, clients: Sequence[int], config: dict[str, Any], inbox: Mapping[int, Any]
    ) -> Fit:
        return Fit(
            round=r,
            clients=tuple(clients),
            weights=self.weights,
            layout=self.layout,
            config=config,
            secure=self.config.secure_aggregation,
            clip=self.config.dp.clip if self.config.dp else None,
            budget_s=self.config.timeout_s * 0.8,
            inbox={c: inbox[c] for c in clients if c in inbox},
        )

    @staticmethod
    def _collect_fitted(replies: Mapping[Target, Fitted], dropped: dict[int, str]) -> list[Fitted]:
        for f in replies.values():
            dropped.update(f.failed)
        return list(replies.values())

    def _plain(
        self,
        r: int,
        groups: Mapping[Target, list[int]],
        config: dict[str, Any],
        dropped: dict[int, str],
    ) -> tuple[np.ndarray | None, float, list[Fitted]]:
        msgs = {t: (self._fit(r, cs, config, {}), cs) for t, cs in groups.items()}
        fitted = self._collect_fitted(self._exchange(msgs, dropped), dropped)
        if self.config.dp is None:
            return None, 0.0, fitted  # the strategy sees every update
        total = np.zeros(self.layout.size, np.float64)
        for f in fitted:
            for d in f.deltas.values():
                total += d
        return total, float(sum(len(f.deltas) for f in fitted)), fitted

    def _secure(
        self,
        r: int,
        groups: Mapping[Target, list[int]],
        config: dict[str, Any],
        dropped: dict[int, str],
    ) -> tuple[np.ndarray | None, float, list[Fitted]]:
        replies = self._exchange(
            {t: (Advertise(r, tuple(cs)), cs) for t, cs in groups.items()}, dropped
        )
        adverts = [a for rep in replies.values() for a in rep.adverts]
        if len(adverts) < 2:
            return None, 0.0, []
        ids = [a.client for a in adverts]
        degree = self.config.degree or default_degree(len(ids))
        graph = neighbours(ids, degree, seed=self.config.seed * 1_000_003 + r)
        threshold = min(len(vs) for vs in graph.values()) // 2 + 1
        server = SecAggServer(r, self.layout.size + 1, threshold=threshold)
        peers = server.advertised(adverts, graph)
        alive = {t: [c for c in cs if c in peers] for t, cs in groups.items() if t in replies}
        shares = self._exchange(
            {
                t: (ShareSeeds(r, threshold, {c: peers[c] for c in cs}), cs)
                for t, cs in alive.items()
            },
            dropped,
        )
        outgoing: dict[int, dict[int, bytes]] = {}
        for rep in shares.values():
            outgoing.update(rep.outgoing)
            dropped.update(rep.failed)
        inbox = server.route(outgoing)
        alive = {t: [c for c in cs if c in outgoing] for t, cs in alive.items() if t in shares}
        fits = self._exchange(
            {t: (self._fit(r, cs, config, inbox), cs) for t, cs in alive.items()}, dropped
        )
        fitted = self._collect_fitted(fits, dropped)
        for f in fits.values():
            if f.examples:
                server.add(f.examples, f.masked)
        if len(server.survivors) < self.strategy.min_clients:
            return None, 0.0, fitted
        holders = {t: list(f.examples) for t, f in fits.items() if f.examples}
        unmask = Unmask(r, tuple(server.dropped))
        answers: dict[int, Any] = {}
        for rep in self._exchange({t: (unmask, cs) for t, cs in holders.items()}, {}).values():
            answers.update(rep.answers)
        try:
            jobs = server.needed(answers)
            seeds = self._combine(jobs)
            total = FIXED.decode(server.finish(answers, seeds))
        except SecAggError as e:
            logger.warning("raymesh.federated: round %d: %s", r, e)
            for f in fitted:
                dropped.update(dict.fromkeys(f.examples, f"secure aggregation failed: {e}"))
            return None, 0.0, []
        return total[:-1], float(total[-1]), fitted

    def _combine(self, jobs: Mapping[tuple[str, int], list[Any]]) -> dict[tuple[str, int], bytes]:
        """Rebuild the round's Shamir secrets on the procs, in parallel (PyCryptodome's
        combine is pure Python, a few ms each); the controller redoes what a proc failed."""
        keys = list(jobs)
        live: list[HostProc | None] = [h for h in self.hosts if h.index not in self._lost]
        live = live or [None]
        chunks = [keys[i :: len(live)] for i in range(len(live))]
        out: dict[tuple[str, int], bytes] = {}
        waiting = []
        for h, chunk in zip(live, chunks, strict=True):
            msg = Combine(tuple(tuple(jobs[k]) for k in chunk))
            waiting.append((chunk, h.send(msg) if h is not None and chunk else None))
        for chunk, future in waiting:
            try:
                secrets = future.get(timeout=self.config.timeout_s) if future else None
            except Exception:
                secrets = None
            if secrets is None or len(secrets) != len(chunk):
                secrets = [combine(jobs[k]) for k in chunk]
            out.update(zip(chunk, secrets, strict=True))
        return out

    def _metrics(self, fitted: Sequence[Fitted]) -> dict[str, float]:
        out: dict[str, float] = {}
        losses = [f.figures[c]["loss"] for f in fitted for c in f.figures if "loss" in f.figures[c]]
        if losses:
            out["loss"] = float(np.mean(losses))
        if self.evaluate_fn is not None:
            self._model.load_state_dict(_state_dict(self.layout, self.weights, self.template))
            got = self.evaluate_fn(self._model)
            figures = got if isinstance(got, Mapping) else {"accuracy": got}
            out.update({k: float(v) for k, v in figures.items()})
        return out

    def _replace_lost(self) -> int:
        lost, self._lost = sorted(self._lost), set()
        for i in lost:
            old = self.hosts[i]
            try:
                old.procs.kill()
            except Exception:
                pass
            self.hosts[i] = self._spawn(i)
            logger.warning(
                "raymesh.federated: client proc %d replaced (pid %d -> %d)",
                i,
                old.pid,
                self.hosts[i].pid,
            )
        return len(lost)


def run(
    client_fn: Callable[[int], Any],
    strategy: Strategy,
    *,
    clients: int,
    rounds: int,
    secure_aggregation: bool = False,
    dp: DP | None = None,
    evaluate_fn: Callable[[torch.nn.Module], Any] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    **options: Any,
) -> Result:
    """Run `rounds` federated rounds and return the history and the final model.

    `client_fn(cid)` builds client `cid` (a `Client`) on whichever proc hosts it;
    `evaluate_fn(model)`, in the controller after each round, returns a float ("accuracy")
    or a dict of figures; `on_round(record)` sees each round's record. `options` are
    RunConfig's other fields (hosts, timeout_s, edge, ...)."""
    config = RunConfig(
        clients=clients, rounds=rounds, secure_aggregation=secure_aggregation, dp=dp, **options
    )
    fed = Federation(client_fn, strategy, config, evaluate_fn)
    history: list[RoundRecord] = []
    try:
        if fed.edge is not None and config.edge is not None and config.edge.wait_for:
            got = fed.edge.wait_for(config.edge.wait_for, config.edge.join_timeout_s)
            if got < config.edge.wait_for:
                logger.warning(
                    "raymesh.federated: %d of %d edge clients joined within %g s; starting",
                    got,
                    config.edge.wait_for,
                    config.edge.join_timeout_s,
                )
        for r in range(1, rounds + 1):
            record = fed.run_round(r)
            history.append(record)
            if on_round is not None:
                on_round(record)
    finally:
        fed.stop()
    epsilon = fed.accountant.epsilon if fed.accountant else None
    return Result(history, epsilon, fed.layout, fed.weights, fed.template)
