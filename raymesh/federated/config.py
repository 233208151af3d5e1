"""`RunConfig`: how a federated run is laid out, checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

from raymesh.federated.privacy import DP
from raymesh.federated.server import EdgeConfig

__all__ = ["RunConfig"]


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """How a federated run is laid out. `clients`: simulated clients, ids 0..clients-1 (edge
    clients get the ids after); `hosts`: procs carrying them (default: one per free CPU, at
    most 8); `keep_clients`: clients a proc keeps built; `timeout_s`: the most one step of a
    round waits; `degree`: secure aggregation's neighbours per client (default O(log n));
    `max_examples`: the largest example count one client may report (its weight in the mean:
    a client reporting more is dropped, so no client outweighs this many examples)."""

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
    max_examples: int = 1_000_000

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
        if self.edge is not None and not isinstance(self.edge, EdgeConfig):
            raise bad("edge", "give raymesh.federated.EdgeConfig(...)")
        if (
            isinstance(self.max_examples, bool)
            or not isinstance(self.max_examples, int)
            or not 1 <= self.max_examples < 2**31
        ):
            raise bad("max_examples", "give the largest count one client may report, 1..2**31-1")
