"""`ServeConfig`: how a model is served (replicas, batching, the HTTP front), checked on
construction; and the `[serve]` table of a job file."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from raymesh.serve.batching import BatchConfig
from raymesh.serve.scaling import AutoscalePolicy

__all__ = ["TOKEN_ENV", "ServeConfig"]

# The bearer token when `token` is not given (so it stays out of shell history and `ps`).
TOKEN_ENV = "RAYMESH_SERVE_TOKEN"
BACKENDS = ("raymesh", "ray-serve")


def _bad(field: str, value: object, fix: str) -> ValueError:
    return ValueError(f"{field}={value!r}: {fix}")


def _int(field: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise _bad(field, value, f"give an integer >= {low}")


def _seconds(field: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _bad(field, value, "give a number of seconds > 0")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Every field is checked on construction: a bad one raises ValueError naming it, the
    value and the fix. `replicas` is a count, or (min, max) to autoscale between them."""

    replicas: int | tuple[int, int] = 1
    # Dynamic batching (see raymesh.serve.batching).
    max_batch_size: int = 32
    batch_wait_ms: float = 5.0
    max_queue: int = 1024
    # The HTTP front.
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000  # 0: any free port (read it from App.url)
    token: str | None = None  # bearer token for /v1 and /admin; None: $RAYMESH_SERVE_TOKEN
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 30.0  # a request not answered by then is a 504
    max_retries: int = 3  # resends of a request whose replica died before answering
    max_tokens: int = 1024  # the most tokens one /v1/generate request may ask for
    # The replicas.
    cpus_per_replica: float = 1.0
    gpus: bool = False  # one GPU per replica
    start_timeout_s: float = 120.0  # for a replica to start and load its model
    # Autoscaling (see raymesh.serve.scaling), when replicas is (min, max).
    queue_up: float = 4.0
    latency_up_ms: float | None = None
    busy_down: float = 0.5
    cooldown_s: float = 5.0
    backend: str = "raymesh"  # or "ray-serve": a Ray Serve deployment with Serve's batching

    def __post_init__(self) -> None:
        replicas = self.replicas
        if isinstance(replicas, list):  # from TOML
            object.__setattr__(self, "replicas", replicas := tuple(replicas))
        if isinstance(replicas, tuple):
            if len(replicas) != 2:
                raise _bad("replicas", replicas, "give a count or (min, max), e.g. (1, 4)")
            _int("replicas min", replicas[0], 1)
            _int("replicas max", replicas[1], 1)
        else:
            _int("replicas", replicas, 1)
        for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_tokens"):
            _int(name, getattr(self, name), 1)
        _int("max_retries", self.max_retries, 0)
        _int("port", self.port, 0)
        if self.port > 65535:
            raise _bad("port", self.port, "give a TCP port 0..65535 (0: any free port)")
        if not isinstance(self.host, str) or not self.host:
            raise _bad("host", self.host, 'give an address to bind, e.g. "127.0.0.1"')
        if self.token is not None and (not isinstance(self.token, str) or not self.token):
            raise _bad("token", "<hidden>", "give a non-empty string, or None for no token")
        for name in ("request_timeout_s", "start_timeout_s"):
            _seconds(name, getattr(self, name))
        cpus = self.cpus_per_replica
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0:
            raise _bad("cpus_per_replica", cpus, "give a number of CPUs > 0, e.g. 1 or 0.5")
        if not isinstance(self.gpus, bool):
            raise _bad("gpus", self.gpus, "give true (one GPU per replica) or false")
        if self.backend not in BACKENDS:
            raise _bad("backend", self.backend, f"give one of {BACKENDS}")
        self.batch()  # checks the batching fields
        self.autoscale()  # checks the autoscaling fields and min <= max

    @property
    def min_replicas(self) -> int:
        return self.replicas[0] if isinstance(self.replicas, tuple) else self.replicas

    @property
    def max_replicas(self) -> int:
        return self.replicas[1] if isinstance(self.replicas, tuple) else self.replicas

    def bearer(self) -> str | None:
        """The token requests must carry: `token`, else $RAYMESH_SERVE_TOKEN, else None."""
        return self.token if self.token is not None else (os.environ.get(TOKEN_ENV) or None)

    def batch(self) -> BatchConfig:
        return BatchConfig(
            max_batch_size=self.max_batch_size,
            batch_wait_ms=self.batch_wait_ms,
            max_queue=self.max_queue,
        )

    def autoscale(self) -> AutoscalePolicy:
        latency = self.latency_up_ms
        return AutoscalePolicy(
            min=self.min_replicas,
            max=self.max_replicas,
            queue_up=self.queue_up,
            latency_up_s=None if latency is None else latency / 1000.0,
            busy_down=self.busy_down,
            cooldown_s=self.cooldown_s,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "serve") -> ServeConfig:
        """From a job file's `[serve]` table; an unknown key is a ValueError listing the keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(
                f"[{where}] has unknown key(s) {unknown}; the keys are {sorted(names)}"
            )
        return cls(**data)
