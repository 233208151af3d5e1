"""`RunConfig`: how a federated run is laid out, and `EdgeConfig`: where its edge clients
connect and the limits they meet; each checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

from raymesh._common import Tls, check_token, is_int
from raymesh.federated.protocol.privacy import DP

__all__ = ["MIN_BODY_RATE", "MIN_BODY_S", "EdgeConfig", "RunConfig"]

# The slowest uplink an honest device's answer is allowed (bytes/s), and the least time a body
# gets whatever its size: EdgeConfig.body_deadline.
MIN_BODY_RATE = 256 * 1024
MIN_BODY_S = 60.0


@dataclass(frozen=True, kw_only=True)
class EdgeConfig:
    """Where edge clients connect, and the limits they meet."""

    host: str = "127.0.0.1"  # the address to bind; 0.0.0.0 for every interface
    port: int = 0  # 0: any free port (EdgeServer.port / .url say which)
    token: str | None = None  # the bearer token; None: generated (EdgeServer.token), not logged
    wait_for: int = 0  # the first round waits for this many edge clients to join...
    join_timeout_s: float = 300.0  # ...for at most this long
    poll_s: float = 20.0  # a long poll's wait before 204
    # An answer's body limit (413 beyond). None: what an honest answer for the run's model can
    # be (its weights' count x 11 bytes, a uint64 in base64, plus 64 KiB and 256 bytes per
    # secure-aggregation neighbour: raymesh.federated.edge.bodies), so one device cannot make the
    # controller read and parse more than an update.
    max_body_bytes: int | None = None
    # An answer's body must be in within this long of its head (408 and the connection closed
    # beyond). None: the body limit at MIN_BODY_RATE (256 KiB/s), at least 60 s, so a device on
    # a slow uplink can send the largest honest answer (110 MB for 10M floats: 7 minutes).
    body_timeout_s: float | None = None
    max_clients: int = 1000  # devices that may enrol (403 beyond)
    tls: Tls | None = None  # serve HTTPS with this certificate and key

    def __post_init__(self) -> None:
        if not is_int(self.port) or not 0 <= self.port < 65536:
            raise ValueError(f"edge.port={self.port!r}: give a TCP port, or 0 for any free one")
        if self.token is not None:  # the servers' one rule: the edge server's BearerAuth's
            check_token("edge.token", self.token)
        if not is_int(self.wait_for) or self.wait_for < 0:
            raise ValueError(f"edge.wait_for={self.wait_for!r}: give a count >= 0")
        for name in ("join_timeout_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"edge.{name}={getattr(self, name)!r}: give seconds > 0")
        if self.max_body_bytes is not None and (
            not is_int(self.max_body_bytes) or self.max_body_bytes < 1024
        ):
            raise ValueError(
                f"edge.max_body_bytes={self.max_body_bytes!r}: give bytes >= 1024, or None for "
                "what an honest answer for the run's model can be"
            )
        if self.body_timeout_s is not None and (
            isinstance(self.body_timeout_s, bool)
            or not isinstance(self.body_timeout_s, (int, float))
            or not 0 < self.body_timeout_s < float("inf")
        ):
            raise ValueError(
                f"edge.body_timeout_s={self.body_timeout_s!r}: give seconds > 0, or None for "
                f"the body limit at {MIN_BODY_RATE // 1024} KiB/s (at least {MIN_BODY_S:g} s)"
            )
        if not is_int(self.max_clients) or self.max_clients < 1:
            raise ValueError(f"edge.max_clients={self.max_clients!r}: give a count >= 1")
        if self.wait_for > self.max_clients:
            raise ValueError(
                f"edge.wait_for={self.wait_for} > edge.max_clients={self.max_clients}: "
                "raise max_clients or wait for fewer"
            )
        if self.tls is not None and not isinstance(self.tls, Tls):
            raise ValueError(
                f"edge.tls={self.tls!r}: give raymesh.federated.Tls(cert=..., key=...) "
                "([edge.tls] cert and key in a job file)"
            )

    def body_deadline(self, max_bytes: int) -> float:
        """The seconds an answer's body gets (`body_timeout_s`, or what a body of `max_bytes`,
        the body limit, takes at MIN_BODY_RATE, at least MIN_BODY_S)."""
        if self.body_timeout_s is not None:
            return float(self.body_timeout_s)
        return max(MIN_BODY_S, max_bytes / MIN_BODY_RATE)


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

        if not is_int(self.clients) or self.clients < 0:
            raise bad("clients", "give the number of simulated clients, an integer >= 0")
        if self.clients == 0 and (self.edge is None or self.edge.wait_for == 0):
            raise bad("clients", "give simulated clients, or edge clients to wait for")
        if not is_int(self.rounds) or self.rounds < 1:
            raise bad("rounds", "give an integer >= 1")
        if self.hosts is not None and (not is_int(self.hosts) or self.hosts < 1):
            raise bad("hosts", "give a number of procs >= 1, or None for one per free CPU")
        if not self.cpus_per_host > 0:
            raise bad("cpus_per_host", "give CPUs per proc, > 0 (0.5 packs two on a core)")
        if not is_int(self.keep_clients) or self.keep_clients < 1:
            raise bad("keep_clients", "give an integer >= 1")
        if not self.timeout_s > 0:
            raise bad("timeout_s", "give seconds > 0")
        if self.degree is not None and (not is_int(self.degree) or self.degree < 2):
            raise bad("degree", "give an even neighbour count >= 2, or None for O(log n)")
        if self.dp is not None and not isinstance(self.dp, DP):
            raise bad("dp", "give raymesh.federated.DP(clip=..., noise_multiplier=...)")
        if self.edge is not None and not isinstance(self.edge, EdgeConfig):
            raise bad("edge", "give raymesh.federated.EdgeConfig(...)")
        if not is_int(self.max_examples) or not 1 <= self.max_examples < 2**31:
            raise bad("max_examples", "give the largest count one client may report, 1..2**31-1")
