"""`Port`: where values go, and `Reply`, the one reply of a message.

A `Port` sends to a `Sink`: a message's `Reply` (one value, from the proc that received the
message: an `@endpoint(explicit_response_port=True)` method's port) or a channel's receiving
end (`raymesh._src.channel`: any number of values, from any actor the port is sent to). A
`Reply` is settled once, by the endpoint's return, its port or its failure; a port dropped
without a reply fails the call with `raymesh.PortDropped` instead of leaving the caller
waiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from raymesh._src.errors import RemoteFailure

R_contra = TypeVar("R_contra", contravariant=True)

__all__ = ["Port", "Reply", "Sink"]


class Reply:
    """The reply to one message: given once, by the endpoint's return, its `Port`, or its
    failure. The delivering thread waits for it; a broadcast's (nobody waits) sends a failure
    to supervision and drops a value."""

    __slots__ = ("_done", "_lock", "_on_failure", "settled", "value")

    def __init__(self, on_failure: Callable[[RemoteFailure], None] | None) -> None:
        self._lock = threading.Lock()
        self._done = threading.Lock()
        self._done.acquire()
        self._on_failure = on_failure
        self.settled = False
        self.value: Any = None

    def settle(self, value: Any) -> bool:
        with self._lock:
            if self.settled:
                return False
            self.settled = True
            self.value = value
        if self._on_failure is not None and isinstance(value, RemoteFailure):
            self._on_failure(value)
        self._done.release()
        return True

    def dropped(self) -> None:
        if self._on_failure is None:  # a broadcast's port may go unanswered
            self.settle(
                RemoteFailure(
                    "raymesh.PortDropped",
                    "the endpoint dropped its response port without replying; keep the Port "
                    "and call port.send(value) or port.exception(error)",
                    "",
                )
            )

    def wait(self) -> Any:
        self._done.acquire()
        return self.value

    def __reduce__(self) -> Any:
        raise TypeError(
            "a Port replies from the proc that received its message and cannot be sent to "
            "another actor; reply from this proc (any thread), have the other actor return "
            "its result to this one, or open a Channel and send its Port"
        )


class Sink(Protocol):
    """Where a `Port` sends: a message's `Reply`, or a channel (`raymesh._src.channel`)."""

    def settle(self, value: Any) -> bool: ...  # False: it takes no more values

    def dropped(self) -> None: ...  # the Port was garbage-collected


class Port(Generic[R_contra]):
    """Where values go: the reply of one message to an
    `@endpoint(explicit_response_port=True)` method (one value, from the proc that received
    it), or the sending end of a `Channel` (any number of values, from any actor it is sent to).

    `send(value)` sends a value, `exception(error)` an error (the receiving Future raises
    `ActorError`); either may be called from any thread, during the call or after the method
    has returned.
    """

    __slots__ = ("__weakref__", "_sink")

    def __init__(self, sink: Sink) -> None:
        self._sink = sink

    def send(self, obj: R_contra) -> None:
        """Send `obj` (a reply to a `broadcast` message is dropped: nobody waits for it)."""
        if not self._sink.settle(obj):
            raise RuntimeError("this port has already sent its one value")

    def exception(self, obj: BaseException) -> None:
        """Send an error: the receiving Future raises ActorError carrying `obj`'s type,
        message and traceback. The actor keeps serving."""
        if not isinstance(obj, BaseException):
            raise TypeError(f"Port.exception takes an exception, not {type(obj).__name__}")
        if not self._sink.settle(RemoteFailure.from_exception(obj)):
            raise RuntimeError("this port has already sent its one value")

    def __del__(self) -> None:
        try:
            self._sink.dropped()
        except Exception:  # interpreter shutdown
            pass

    def __reduce__(self) -> Any:
        return (Port, (self._sink,))  # a message's reply refuses (see Reply.__reduce__)

    def __repr__(self) -> str:
        return "<Port>"
