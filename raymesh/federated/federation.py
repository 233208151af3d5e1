"""`run`: federated rounds over procs of simulated clients and edge clients over HTTP.

The controller holds the global model as one flat float32 vector. Each round it samples
clients (the strategy), sends each proc one message for all the clients it hosts and each edge
client its own, waits at most `timeout_s` per step, and applies the strategy's step to the mean
update. A client that raises, is not started within the step's time, or sends an answer that
fails its checks (raymesh.federated.protocol.checks: every field, every step) is dropped from
the round with the reason recorded; a proc that dies or does not answer drops all its clients
for that round and is replaced before the next (raymesh.federated.simulation.host_pool). No
answer, however formed, ends the run: at worst its round is not applied, with the reason in its
record. A round with fewer than `min_clients` updates is not applied, nor one whose new weights
would not be finite.

With secure aggregation (raymesh.federated.aggregation.secure_round), each client masks (its update
times its example count, then the count) and the controller only ever holds masked vectors and their
exact sum; dropped clients' masks are removed from the survivors' shares
(raymesh.federated.protocol.secagg), each rebuilt seed verified before use. A round whose decoded
sum is not finite, whose decoded count differs from the counts the clients reported, or (with DP)
whose sum is longer than the clipped updates can add up to, is not applied. With DP, clients are
Poisson-sampled, clip their updates (and the controller clips each update it sees in the clear),
every update counts once, and the controller adds Gaussian noise to the sum before dividing by the
expected number sampled (DP-FedAvg); Opacus's accountant gives epsilon per round
(raymesh.federated.protocol.privacy).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from raymesh.actor import host_mesh
from raymesh.federated.aggregation.secure_round import SecureRound
from raymesh.federated.aggregation.strategy import Strategy, Update
from raymesh.federated.config import RunConfig
from raymesh.federated.edge.server import EdgeServer
from raymesh.federated.protocol.checks import BadUpdate, Checks
from raymesh.federated.protocol.client import Layout
from raymesh.federated.protocol.messages import Fit, Fitted, Message
from raymesh.federated.protocol.privacy import DP, PrivacyAccountant, clip_update
from raymesh.federated.protocol.secagg import default_degree
from raymesh.federated.result import Outcome, Result, RoundRecord, state_dict
from raymesh.federated.simulation.host import HostProc, spawn_host
from raymesh.federated.simulation.host_pool import HostPool

# RunConfig, Result and RoundRecord live in their own modules; they are named here too, where
# a run's config goes in and its result comes out (raymesh.federated.jobfile imports RunConfig
# from here).
__all__ = ["Federation", "Result", "RoundRecord", "RunConfig", "run"]

logger = logging.getLogger("raymesh.federated")

SPAWN_TIMEOUT_S = 120.0


class _Edge:
    """One edge client as a round target."""

    def __init__(self, server: EdgeServer, cid: int) -> None:
        self.server, self.cid = server, cid

    def send(self, msg: Message, check: Callable[[Any], None]) -> Any:
        return self.server.send(self.cid, msg, check)

    def __repr__(self) -> str:
        return f"edge client {self.cid}"


Target = HostProc | _Edge


class Federation:
    """The procs, the edge server and the global model of one run; `run_round` is one round,
    `run` all of them. Tests put clients in this process by overriding `_spawn`."""

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
        self._check = Checks(self.layout.size, config.max_examples)
        self.accountant = PrivacyAccountant(config.dp) if config.dp else None
        self.pool = HostPool(self._spawn)
        self.edge: EdgeServer | None = None
        try:
            if config.clients:
                n = config.hosts or self._default_hosts()
                self.pool.start(min(n, config.clients))
            if config.edge is not None:
                self.edge = EdgeServer(
                    config.edge,
                    first_cid=config.clients,
                    size=self.layout.size,
                    peers=self._most_peers(),
                )
                if config.edge.token is None:  # never its value: logs are read by many
                    logger.info(
                        "raymesh.federated: no edge token was given, so one was generated; "
                        "read it from Federation.edge.token (it is not logged)"
                    )
                logger.info(
                    "raymesh.federated: edge clients connect with `raymesh federated client "
                    "--server %s --token-file <a file holding the token> --client "
                    "module:client_fn%s`",
                    self.edge.url,
                    " --ca-file <the server's certificate>" if config.edge.tls else "",
                )
        except BaseException:
            self.stop()
            raise

    def _most_peers(self) -> int:
        """The most secure-aggregation neighbours a client can have (each sends a share and
        reveals a seed for each), 0 without secure aggregation."""
        if not self.config.secure_aggregation:
            return 0
        edge = self.config.edge
        n = self.config.clients + (edge.max_clients if edge is not None else 0)
        # The graph gives each client `degree` neighbours (2 at least), or all the others.
        return max(2, min(n - 1, self.config.degree or default_degree(n)))

    @property
    def hosts(self) -> list[HostProc]:
        """The client procs, by index (a replaced one takes its predecessor's place)."""
        return self.pool.hosts

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
        self.pool.stop()

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
        that fails or answers wrongly drops its clients (`dropped`, with the reason); a proc
        that failed is replaced after the round. Raises nothing for any answer."""
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
                if not isinstance(t, _Edge):  # the edge server checked it before accepting it
                    self._check(msg, clients, reply)  # raises BadUpdate only
                out[t] = reply
            except BadUpdate as e:
                reason = f"refused: {str(e)[:300]}"
                logger.warning("raymesh.federated: %s: %s", t, reason[:200])
                dropped.update(dict.fromkeys(clients, reason))
            except Exception as e:
                reason = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if isinstance(t, HostProc):
                    reason = f"its proc failed ({reason})"
                    self.pool.lose(t.index)
                logger.warning("raymesh.federated: %s: %s", t, reason)
                dropped.update(dict.fromkeys(clients, reason))
        return out

    def _bind(self, msg: Message, clients: Sequence[int]) -> Callable[[Any], None]:
        return lambda reply: self._check(msg, clients, reply)

    def run_round(self, r: int) -> RoundRecord:
        started = time.monotonic()
        population = self.population()
        if self.accountant is not None:  # the accountant's analysis assumes Poisson sampling
            sampled = self.accountant.sample(population, self.strategy.fraction)
        else:
            sampled = self.strategy.sample(r, population, self.config.seed)
        dropped: dict[int, str] = {}
        groups = self._assign(sampled)
        config = self.strategy.client_config(r)
        if self.config.secure_aggregation:
            out = SecureRound(
                r,
                self.config,
                exchange=self._exchange,
                fit=lambda cs, inbox: self._fit(r, cs, config, inbox),
                size=self.layout.size,
                min_clients=self.strategy.min_clients,
            ).run(groups, dropped)
        else:
            out = self._plain(r, groups, config, dropped)
        responded = sum(len(f.examples) for f in out.fitted)
        reason = out.reason
        if not reason and responded < self.strategy.min_clients:
            reason = f"{responded} of {len(sampled)} clients answered, min_clients is "
            reason += f"{self.strategy.min_clients}: the round is not applied"
        applied = False
        if not reason:
            reason, weights = self._step(out, len(population))
            if weights is not None:
                self.weights, applied = weights, True
        if reason:
            logger.warning("raymesh.federated: round %d: %s", r, reason)
        epsilon = None
        if self.accountant is not None:  # spent whether or not the round is applied
            epsilon = self.accountant.step(sample_rate=self.strategy.fraction)
        metrics = self._metrics(out.fitted)
        replaced = self.pool.replace_lost()
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
            ignored=out.ignored,
        )

    def _step(self, out: Outcome, population: int) -> tuple[str, np.ndarray | None]:
        """The next global weights from the round's outcome, or the reason there are none."""
        current = self.layout.unflatten(self.weights)
        if out.total is None:
            updates = [
                Update(c, self.layout.unflatten(f.deltas[c]), f.examples[c])
                for f in out.fitted
                for c in f.examples
            ]
            weights = self.layout.flatten(self.strategy.aggregate(current, updates))
        else:
            total, weight = out.total, out.weight
            if self.accountant is not None:
                total = total + self.accountant.noise(total.shape)
                # The expected number sampled, not who answered: the divisor must not
                # depend on the clients (DP-FedAvg's fixed-denominator estimator).
                weight = self.strategy.fraction * population
            mean = self.layout.unflatten((total / weight).astype(np.float32))
            weights = self.layout.flatten(self.strategy.apply(current, mean))
        if not np.all(np.isfinite(weights)):
            return "the new weights would not be finite: the round is not applied", None
        return "", weights

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
            max_examples=self.config.max_examples,
        )

    def _plain(
        self,
        r: int,
        groups: Mapping[Target, list[int]],
        config: dict[str, Any],
        dropped: dict[int, str],
    ) -> Outcome:
        msgs = {t: (self._fit(r, cs, config, {}), cs) for t, cs in groups.items()}
        fitted = list(self._exchange(msgs, dropped).values())
        for f in fitted:
            dropped.update(f.failed)
        if self.config.dp is None:
            return Outcome(None, 0.0, fitted)  # the strategy sees every update
        clip = self.config.dp.clip
        total = np.zeros(self.layout.size, np.float64)
        for f in fitted:
            for d in f.deltas.values():
                # Clipped here too: an edge client runs whatever code it likes.
                total += clip_update({"u": d}, clip)["u"]
        return Outcome(total, float(sum(len(f.deltas) for f in fitted)), fitted)

    def run(self, on_round: Callable[[RoundRecord], None] | None = None) -> Result:
        """All the config's rounds (after waiting for its edge clients), then `stop()`."""
        history: list[RoundRecord] = []
        edge = self.config.edge
        try:
            if self.edge is not None and edge is not None and edge.wait_for:
                got = self.edge.wait_for(edge.wait_for, edge.join_timeout_s)
                if got < edge.wait_for:
                    logger.warning(
                        "raymesh.federated: %d of %d edge clients joined within %g s; starting",
                        got,
                        edge.wait_for,
                        edge.join_timeout_s,
                    )
            for r in range(1, self.config.rounds + 1):
                record = self.run_round(r)
                history.append(record)
                if on_round is not None:
                    on_round(record)
        finally:
            self.stop()
        epsilon = self.accountant.epsilon if self.accountant else None
        return Result(history, epsilon, self.layout, self.weights, self.template)

    def _metrics(self, fitted: Sequence[Fitted]) -> dict[str, float]:
        out: dict[str, float] = {}
        losses = [f.figures[c]["loss"] for f in fitted for c in f.figures if "loss" in f.figures[c]]
        if losses:
            out["loss"] = float(np.mean(losses))
        if self.evaluate_fn is not None:
            self._model.load_state_dict(state_dict(self.layout, self.weights, self.template))
            got = self.evaluate_fn(self._model)
            figures = got if isinstance(got, Mapping) else {"accuracy": got}
            out.update({k: float(v) for k, v in figures.items()})
        return out


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
    return Federation(client_fn, strategy, config, evaluate_fn).run(on_round)
