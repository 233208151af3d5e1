"""`App`: a running server, whichever backend serves it; what `deploy` returns.

Both backends are an `App`: raymesh's own (`raymesh.serve.server.Server`: the front and the
router on a thread of the controller) and Ray Serve's (`raymesh.serve._ray_serve.RayServeApp`).
Each answers `url`, `predict.call_one(x)` and `stop()`; what a backend leaves to another system
(Ray Serve's reload, streaming and statistics) raises NotImplementedError saying where it is.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

from raymesh._common import Pending

__all__ = ["App", "Endpoint", "Reply"]

# The pending answer to a Python call: `get(timeout)` blocks for it (TimeoutError after
# `timeout` seconds; the call goes on), `done()` never blocks.
Reply = Pending


class Endpoint:
    """A route of the server, called from Python: `call_one(...)` sends through the same queue
    and batching as HTTP requests, and returns its `Reply` at once."""

    def __init__(self, call: Callable[..., Reply]) -> None:
        self._call = call

    def call_one(self, *args: Any, **kwargs: Any) -> Reply:
        return self._call(*args, **kwargs)


class App(abc.ABC):
    """A running server: `url`, `predict.call_one(x)`, `generate.call_one(prompt,
    max_tokens, temperature, seed)` (the whole text), `reload(checkpoint)`, `stats()`,
    `stop()`; a context manager that stops it."""

    port: int  # the port it listens on (the one given, or the free one taken for port=0)
    predict: Endpoint
    generate: Endpoint

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Where it serves, e.g. http://127.0.0.1:8000."""

    @abc.abstractmethod
    def reload(self, checkpoint: str) -> str:
        """Move every replica to `checkpoint` with no failed request; returns the step folder
        now served."""

    @abc.abstractmethod
    def replica_pids(self) -> list[int]:
        """The process ids of the replicas ready now."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Replicas, batch sizes, resends, scaling decisions."""

    @abc.abstractmethod
    def stop(self) -> None:
        """Stop serving; idempotent."""

    def __enter__(self) -> App:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<raymesh.serve.App {self.url}>"
