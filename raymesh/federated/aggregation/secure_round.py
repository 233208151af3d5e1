"""Secure aggregation's round: its four steps driven over the round's targets.

Each client masks its update times its example count, then the count (with DP, its clipped
update, then 1), and the controller only ever holds masked vectors and their exact sum:
1. Advertise: each client sends its public keys; the neighbour graph is drawn from them
   (`degree` neighbours each, O(log n) by default, from the run's seed and the round);
2. ShareSeeds: each shares its seeds with its neighbours, through the controller, encrypted;
3. Fit: each trains and sends its masked update (procs sum theirs first);
4. Unmask: the survivors reveal the shares that remove the dropped clients' masks and their
   own self-masks; `SecAggServer.finish` rebuilds every seed in the controller (NumPy over a
   prime field: no round trip to the procs), verifies each, and searches other sets of
   shares for a seed that fails.
A client that fails a step is dropped (the steps after go on without it); a round whose decoded
sum fails `checks.sum_problem` (not finite, a weight that is not what the clients reported, or
with DP longer than the clipped updates can add up to) is not applied, with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from raymesh.federated.aggregation.secagg_server import SecAggServer
from raymesh.federated.config import RunConfig
from raymesh.federated.protocol.checks import sum_problem
from raymesh.federated.protocol.messages import FIXED, Advertise, Fit, Message, ShareSeeds, Unmask
from raymesh.federated.protocol.secagg import SecAggError, default_degree, neighbours
from raymesh.federated.result import Outcome

__all__ = ["SecureRound"]

T = TypeVar("T", bound=Hashable)  # where clients train: a client proc, or an edge client
# Sends each target its message for its clients; returns the valid answers that came in time
# and records why each other client dropped out (Federation._exchange).
Exchange = Callable[[Mapping[T, tuple[Message, Sequence[int]]], dict[int, str]], dict[T, Any]]


class SecureRound(Generic[T]):
    """One round `r` of secure aggregation. exchange: one step over the targets; fit(clients,
    inbox): the Fit message for those clients, with the shares routed to them; size: the
    model's float count; min_clients: the fewest updates worth unmasking."""

    def __init__(
        self,
        r: int,
        config: RunConfig,
        *,
        exchange: Exchange[T],
        fit: Callable[[Sequence[int], Mapping[int, Any]], Fit],
        size: int,
        min_clients: int,
    ) -> None:
        self.r, self.config = r, config
        self._exchange, self._fit = exchange, fit
        self.size, self.min_clients = size, min_clients

    def run(self, groups: Mapping[T, list[int]], dropped: dict[int, str]) -> Outcome:
        """The round's masked sum, decoded, from `groups` (each target's clients); each client
        that drops out is recorded in `dropped` with the reason."""
        r = self.r
        replies = self._exchange(
            {t: (Advertise(r, tuple(cs)), cs) for t, cs in groups.items()}, dropped
        )
        adverts = [a for rep in replies.values() for a in rep.adverts]
        if len(adverts) < 2:
            return Outcome(None, 0.0, [], f"{len(adverts)} clients advertised keys: too few")
        ids = [a.client for a in adverts]
        degree = self.config.degree or default_degree(len(ids))
        graph = neighbours(ids, degree, seed=self.config.seed * 1_000_003 + r)
        threshold = min(len(vs) for vs in graph.values()) // 2 + 1
        server = SecAggServer(r, self.size + 1, threshold=threshold)
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
            {t: (self._fit(cs, inbox), cs) for t, cs in alive.items() if cs}, dropped
        )
        for t, f in list(fits.items()):
            dropped.update(f.failed)
            if not f.examples:
                continue
            try:
                server.add(f.examples, f.masked)
            except SecAggError as e:
                dropped.update(dict.fromkeys(f.examples, f"refused: {e}"))
                del fits[t]
        fitted = list(fits.values())
        if len(server.survivors) < self.min_clients:
            return Outcome(None, 0.0, fitted)  # run_round gives the reason
        holders = {t: list(f.examples) for t, f in fits.items() if f.examples}
        unmask = Unmask(r, tuple(server.dropped))
        refused: dict[int, str] = {}  # their updates count; their shares do not
        answers: dict[int, Any] = {}
        msgs = {t: (unmask, cs) for t, cs in holders.items()}
        for rep in self._exchange(msgs, refused).values():
            answers.update(rep.answers)
        try:
            total = FIXED.decode(server.finish(answers))
        except SecAggError as e:
            return Outcome(None, 0.0, fitted, f"secure aggregation failed: {e}", refused)
        counts = [n for f in fitted for n in f.examples.values()]
        clip = self.config.dp.clip if self.config.dp is not None else None
        problem, ignored = sum_problem(total, counts, clip), {**server.ignored, **refused}
        return Outcome(total[:-1], float(total[-1]), fitted, problem, ignored)
