"""A server's config in sections, each handed only to the rooms that read it:

- `RouterConfig` (the router): `ReplicaConfig` for the pool (how many replicas, what each
  reserves, how long one may take to load; the reloader's bound on a reload too), the
  `AutoscalePolicy` for the autoscaler, and the dispatcher's bounds on a request (its timeout,
  its resends);
- `BatchConfig` (`raymesh.serve.batching`, the batcher): how requests are batched;
- `FrontConfig` (the HTTP front, and the Ray Serve deployment's request checks): where it
  listens, the tokens settled, the limits on a request.

A user writes `ServeConfig`'s flat fields (keyword arguments, or a job file's `[serve]` keys);
`ServeConfig.router`, `.batch` and `.front` build these from them, checked there, so the
sections are plain frozen data with no defaults of their own. `ServeConfig.front` settles the
tokens from the environment when it is read: read it once per server, so every room sees the
same tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymesh._common import Range, Tls
from raymesh.serve.scaling import AutoscalePolicy

__all__ = ["FrontConfig", "ReplicaConfig", "RouterConfig"]


@dataclass(frozen=True, kw_only=True)
class ReplicaConfig:
    """The replica pool's: how many replicas (`replicas.min` at the start, at most
    `replicas.max`), and how each starts."""

    replicas: Range
    cpus: float  # each replica's proc reserves this many CPUs (and torch uses as many threads)
    gpus: bool  # one GPU per replica
    start_timeout_s: float  # for a replica to start and load its model (or to reload)
    max_streams: int  # token streams one replica decodes at once, where its model can batch


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    """The router's, room by room."""

    replicas: ReplicaConfig  # the pool (and the reloader)
    autoscale: AutoscalePolicy  # the autoscaler; its min and max are `replicas.replicas`
    request_timeout_s: float  # the dispatcher: not answered by then is a TimeoutError (504)
    max_retries: int  # the dispatcher: resends of a request whose replica died


@dataclass(frozen=True, kw_only=True)
class FrontConfig:
    """The HTTP front's, with its tokens settled (no environment read after this)."""

    host: str
    port: int  # 0: any free port
    token: str | None  # the bearer token of /v1 and /metrics; None: no check
    admin_token: str | None  # the token of POST /admin/reload; None: the route is off
    checkpoint_root: str | None  # /admin/reload loads only from under this folder
    tls: Tls | None
    max_body_bytes: int
    body_timeout_s: float  # the guard's 408 in the error shape; uvicorn's cut-off just after
    head_timeout_s: float  # a request head not in by then: 408, connection closed
    max_connections: int
    keep_alive_s: float
    max_tokens: int  # the most tokens one /v1/generate request may ask for
