"""`ServeConfig`: how a model is served (replicas, batching, the HTTP front), checked on
construction; and the `[serve]` table of a job file. Written flat; its sections (`router`,
`batch`, `front`: raymesh.serve.sections) are what the server's rooms are handed."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from raymesh._common import Range, Tls, bad, check_int, check_seconds, check_token, from_table
from raymesh.serve.batching import BatchConfig
from raymesh.serve.scaling import AutoscalePolicy
from raymesh.serve.sections import FrontConfig, ReplicaConfig, RouterConfig

__all__ = ["ADMIN_TOKEN_ENV", "TOKEN_ENV", "ServeConfig"]

# The tokens when `token` / `admin_token` are not given (so they stay out of shell history and
# `ps`).
TOKEN_ENV = "RAYMESH_SERVE_TOKEN"
ADMIN_TOKEN_ENV = "RAYMESH_SERVE_ADMIN_TOKEN"
BACKENDS = ("raymesh", "ray-serve")
# What Ray Serve's proxy, not raymesh, decides for backend="ray-serve": a field set to
# anything but its default there is refused, rather than silently not applied.
_RAYMESH_FRONT_ONLY = {
    "admin_token": "Ray Serve serves no /admin/reload (reload is Serve's business there)",
    "checkpoint_root": "Ray Serve serves no /admin/reload (reload is Serve's business there)",
    "tls": "Ray Serve's proxy serves the HTTP (HTTPS is set on Serve's own http_options)",
    "max_connections": "Ray Serve's proxy holds the connections",
    "keep_alive_s": "Ray Serve's proxy holds the connections (its keep_alive_timeout_s)",
    "head_timeout_s": "Ray Serve's proxy reads the request heads",
    "max_streams": "Ray Serve's replicas decode one stream per call",
}


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """Every field is checked on construction: a bad one raises ValueError naming it, the
    value and the fix. `replicas` is a count, or (min, max) to autoscale between them.
    `router`, `batch` and `front` are its sections, what each room of a server is handed."""

    replicas: int | tuple[int, int] = 1
    # Dynamic batching (see raymesh.serve.batching).
    max_batch_size: int = 32
    batch_wait_ms: float = 5.0
    max_queue: int = 1024
    # The HTTP front.
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000  # 0: any free port (read it from App.url)
    token: str | None = None  # bearer token for /v1 and /metrics; None: $RAYMESH_SERVE_TOKEN
    # Bearer token for POST /admin/reload; None: $RAYMESH_SERVE_ADMIN_TOKEN; neither: the
    # route is off (403). It needs checkpoint_root, and must differ from `token`.
    admin_token: str | None = None
    checkpoint_root: str | None = None  # /admin/reload loads only from under this folder
    tls: Tls | None = None  # HTTPS: serve.Tls(cert=..., key=...); {cert = ..., key = ...} in TOML
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 10.0  # a body not all in by then is a 408 (slow clients)
    head_timeout_s: float = 10.0  # a request head not all in by then is a 408, and closed
    max_connections: int = 1024  # open at once; uvicorn answers 503 beyond
    keep_alive_s: float = 5.0  # an idle keep-alive connection is closed after this
    request_timeout_s: float = 30.0  # a request not answered by then is a 504
    max_retries: int = 3  # resends of a request whose replica died before answering
    max_tokens: int = 1024  # the most tokens one /v1/generate request may ask for
    # The replicas.
    cpus_per_replica: float = 1.0
    gpus: bool = False  # one GPU per replica
    start_timeout_s: float = 120.0  # for a replica to start and load its model
    # The /v1/generate streams a replica decodes at once, as one batch that streams join and
    # leave between tokens (a Hugging Face causal LM generating with raymesh.train.hf's
    # generate; any other model's generate function takes one stream at a time). 1: one at a
    # time, each with its own KV cache.
    max_streams: int = 16
    # Autoscaling (see raymesh.serve.scaling), when replicas is (min, max).
    queue_up: float = 4.0
    latency_up_ms: float | None = None
    busy_down: float = 0.5
    cooldown_s: float = 5.0
    backend: str = "raymesh"  # or "ray-serve": a Ray Serve deployment with Serve's batching

    def __post_init__(self) -> None:
        object.__setattr__(self, "replicas", Range.check("replicas", self.replicas))
        for name in ("max_batch_size", "max_queue", "max_body_bytes", "max_tokens", "max_streams"):
            check_int(name, getattr(self, name), 1)
        check_int("max_retries", self.max_retries, 0)
        check_int("port", self.port, 0)
        if self.port > 65535:
            raise bad("port", self.port, "give a TCP port 0..65535 (0: any free port)")
        if not isinstance(self.host, str) or not self.host:
            raise bad("host", self.host, 'give an address to bind, e.g. "127.0.0.1"')
        for name in ("token", "admin_token"):
            value = getattr(self, name)
            if value is not None:
                check_token(name, value)  # 16+ printable ASCII characters
        root = self.checkpoint_root
        if root is not None:
            if isinstance(root, os.PathLike):
                object.__setattr__(self, "checkpoint_root", root := os.fspath(root))
            if not isinstance(root, str) or not os.path.isdir(root):
                raise bad(
                    "checkpoint_root", root, "give the folder the checkpoints to reload are under"
                )
        if isinstance(self.tls, dict):  # from TOML: {cert = ..., key = ...}
            unknown = sorted(set(self.tls) - {"cert", "key"})
            if unknown:
                raise bad("tls", self.tls, f"unknown key(s) {unknown}; give cert and key")
            object.__setattr__(self, "tls", Tls.of(self.tls.get("cert"), self.tls.get("key")))
        if self.tls is not None and not isinstance(self.tls, Tls):
            raise bad("tls", self.tls, 'give Tls(cert=..., key=...) or {"cert": ..., "key": ...}')
        check_int("max_connections", self.max_connections, 1)
        for name in (
            "request_timeout_s",
            "start_timeout_s",
            "body_timeout_s",
            "head_timeout_s",
            "keep_alive_s",
        ):
            check_seconds(name, getattr(self, name))
        cpus = self.cpus_per_replica
        if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or not cpus > 0:
            raise bad("cpus_per_replica", cpus, "give a number of CPUs > 0, e.g. 1 or 0.5")
        if not isinstance(self.gpus, bool):
            raise bad("gpus", self.gpus, "give true (one GPU per replica) or false")
        if self.backend not in BACKENDS:
            raise bad("backend", self.backend, f"give one of {BACKENDS}")
        if self.backend == "ray-serve":
            defaults = {f.name: f.default for f in dataclasses.fields(self)}
            for name, why in _RAYMESH_FRONT_ONLY.items():
                value = getattr(self, name)
                if value != defaults[name]:
                    shown = "<hidden>" if name == "admin_token" else value
                    raise bad(
                        name,
                        shown,
                        f'backend="ray-serve" cannot apply it ({why}): leave it out, or '
                        'serve with backend="raymesh"',
                    )
        elif self.admin_token is not None:
            self.check_reload(self.admin_token)
        # The sections check what spans fields: batching's queue holds a batch, autoscaling's
        # min <= max and its thresholds.
        _ = self.batch, self.router

    @property
    def min_replicas(self) -> int:
        return Range.of(self.replicas).min

    @property
    def max_replicas(self) -> int:
        return Range.of(self.replicas).max

    def bearer(self) -> str | None:
        """The token requests must carry: `token`, else $RAYMESH_SERVE_TOKEN, else None
        (ValueError naming the variable when it cannot be a token: see `check_token`)."""
        if self.token is not None:
            return self.token
        token = os.environ.get(TOKEN_ENV) or None
        return None if token is None else check_token(f"${TOKEN_ENV}", token)

    def admin(self) -> str | None:
        """The token POST /admin/reload needs: `admin_token`, else $RAYMESH_SERVE_ADMIN_TOKEN,
        else None (the route is off). Raises ValueError when it is set but cannot be used (no
        `checkpoint_root`, or the same as the bearer token)."""
        if self.backend != "raymesh":
            return None  # no reload route to open
        token = self.admin_token
        if token is None:
            token = os.environ.get(ADMIN_TOKEN_ENV) or None
            if token is not None:
                check_token(f"${ADMIN_TOKEN_ENV}", token)
        if token is not None:
            self.check_reload(token)
        return token

    def check_reload(self, admin_token: str) -> None:
        """ValueError unless an admin token can open POST /admin/reload with this config."""
        if self.checkpoint_root is None:
            raise bad(
                "checkpoint_root",
                None,
                "an admin token (admin_token, --admin-token or $RAYMESH_SERVE_ADMIN_TOKEN) "
                "turns on POST /admin/reload, which loads only from under checkpoint_root: "
                "set it to the folder your checkpoints are in",
            )
        if admin_token == self.bearer():
            raise bad(
                "admin_token",
                "<hidden>",
                "give a token of its own: a client that may predict must not be able to reload",
            )

    # ---- the sections, each handed only to the rooms that read it (raymesh.serve.sections)
    @property
    def router(self) -> RouterConfig:
        latency = self.latency_up_ms
        return RouterConfig(
            replicas=ReplicaConfig(
                replicas=Range.of(self.replicas),
                cpus=self.cpus_per_replica,
                gpus=self.gpus,
                start_timeout_s=self.start_timeout_s,
                max_streams=self.max_streams,
            ),
            autoscale=AutoscalePolicy(
                min=self.min_replicas,
                max=self.max_replicas,
                queue_up=self.queue_up,
                latency_up_s=None if latency is None else latency / 1000.0,
                busy_down=self.busy_down,
                cooldown_s=self.cooldown_s,
            ),
            request_timeout_s=self.request_timeout_s,
            max_retries=self.max_retries,
        )

    @property
    def batch(self) -> BatchConfig:
        return BatchConfig(
            max_batch_size=self.max_batch_size,
            batch_wait_ms=self.batch_wait_ms,
            max_queue=self.max_queue,
        )

    @property
    def front(self) -> FrontConfig:
        """With the tokens settled now (`bearer()`, `admin()`): ValueError when an admin
        token from the environment cannot be used."""
        return FrontConfig(
            host=self.host,
            port=self.port,
            token=self.bearer(),
            admin_token=self.admin(),
            checkpoint_root=self.checkpoint_root,
            tls=self.tls,
            max_body_bytes=self.max_body_bytes,
            body_timeout_s=self.body_timeout_s,
            head_timeout_s=self.head_timeout_s,
            max_connections=self.max_connections,
            keep_alive_s=self.keep_alive_s,
            max_tokens=self.max_tokens,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "serve") -> ServeConfig:
        """From a job file's `[serve]` table; an unknown key is a ValueError listing the keys."""
        return from_table(cls, data, where)
