"""One HTTP connection of a `ServerThread`: uvicorn's protocol (httptools when installed,
else h11, as uvicorn's "auto") with the limits uvicorn lacks.

- Deadlines. A request head (request line and headers) must be complete within
  `head_timeout_s` of the connection opening, or of its first byte on a kept-alive connection,
  and is at most `MAX_HEAD_BYTES` (431 beyond); a body within `body_timeout_s` of its head (a
  pipelined request's: of its turn, once the responses before it are sent). Otherwise the
  server answers 408 (only when no response is being sent) and closes the connection.
  uvicorn has none of its own: its keep-alive timer runs only between requests.
- Lingering close. An app may answer before it has read the whole body (413 at a body limit,
  429 with the body unread). Closing a socket with the client's bytes still arriving makes
  the kernel reset the connection, and the client, still sending, then loses the answer it
  was sent. So, as nginx does, the server sends its FIN after the answer and reads and drops
  what the client still sends, up to `LINGER_BYTES` or `LINGER_S`, closing when the client
  closes its side: an honest client that sent a body too large reads its 413.
"""

from __future__ import annotations

import asyncio
from typing import Any

from raymesh._common.http_error import HTTPError, error_json

__all__ = ["MAX_HEAD_BYTES", "protocol_class"]

MAX_HEAD_BYTES = 64 * 1024  # a request line and headers past this are refused (431)
LINGER_S = 5.0  # how long a closing connection keeps reading what the client still sends
LINGER_BYTES = 4 << 20  # and how much of it, at most

_PROTOCOLS: dict[tuple[float, float], type[asyncio.Protocol]] = {}


def protocol_class(head_s: float, body_s: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with the deadlines and the lingering close of the module
    docstring (one class per pair of deadlines, made once)."""
    key = (head_s, body_s)
    if key not in _PROTOCOLS:
        try:
            from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
        except ImportError:
            from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
        _PROTOCOLS[key] = type(
            "Limited" + base.__name__,
            (_Limits, base),
            {"head_timeout_s": head_s, "body_timeout_s": body_s},
        )
    return _PROTOCOLS[key]


_408 = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
    b"content-length: %d\r\n\r\n%s"
)
_431 = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
)


class _Transport:
    """The transport as uvicorn's protocol sees it: the socket's, whose `close()` lingers
    (`_Limits._close`) and which reads as closing once it does."""

    def __init__(self, transport: Any, connection: _Limits) -> None:
        self._transport, self._connection = transport, connection

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        self._connection._close()

    def is_closing(self) -> bool:
        return self._connection._linger is not None or self._transport.is_closing()


class _Limits:
    """Mixed into uvicorn's protocol class: one timer per connection, armed for the head when
    the connection opens (or a kept-alive one receives its next byte), re-armed for the body
    once the head is in, disarmed once the app has the whole request or has answered; with
    pipelined requests the phase is the oldest unfinished one's. Only uvicorn's per-connection
    attributes are read (`cycle`, `transport`, `loop`; httptools' `pipeline`, its queue of
    pipelined requests, where it has one)."""

    head_timeout_s: float
    body_timeout_s: float
    cycle: Any
    transport: Any
    loop: asyncio.AbstractEventLoop
    _socket: Any = None  # the transport itself (uvicorn holds a `_Transport`)
    _deadline: asyncio.TimerHandle | None = None
    _phase: str | None = None
    _head_bytes = 0  # of the head being received
    _head_tail = b""  # its last 3 bytes: a CRLFCRLF may straddle two reads
    _linger: asyncio.TimerHandle | None = None  # set while the connection lingers
    _linger_left = LINGER_BYTES

    def _waiting_for(self) -> str | None:
        """'head', 'body', or None: what the oldest unfinished request waits for (None: the
        app has it, or is answering it)."""
        if getattr(self, "pipeline", None):
            # httptools has queued a pipelined request (`cycle` is already that one): the one
            # being answered came in whole before it, and the queued one's clock starts when
            # its turn comes (`on_response_complete`).
            return None
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return "head"
        return "body" if cycle.more_body and not cycle.response_started else None

    def _answering(self) -> bool:
        """Whether a response is being sent: bytes of our own may not go between its bytes."""
        cycle = self.cycle
        return bool(getattr(self, "pipeline", None)) or (
            cycle is not None and cycle.response_started and not cycle.response_complete
        )

    def _arm(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = phase
        if phase is not None:
            seconds = self.head_timeout_s if phase == "head" else self.body_timeout_s
            self._deadline = self.loop.call_later(seconds, self._expired)

    def connection_made(self, transport: Any) -> None:
        self._socket = transport
        super().connection_made(_Transport(transport, self))  # type: ignore[misc]
        self._arm("head")

    def data_received(self, data: bytes) -> None:
        if self._linger is not None:
            self._linger_left -= len(data)
            if self._linger_left < 0:
                self._socket.close()
            return
        if self._waiting_for() == "head":
            self._arm("head")  # a kept-alive connection's next request starts its clock
            # The head must end within MAX_HEAD_BYTES (h11 bounds it too; httptools does not).
            room = MAX_HEAD_BYTES - self._head_bytes
            if len(data) > room and b"\r\n\r\n" not in self._head_tail + data[:room]:
                self._refuse(_431, 431, f"the request head is over {MAX_HEAD_BYTES} bytes")
                return
            self._head_bytes += len(data)
            self._head_tail = data[-3:]
        super().data_received(data)  # type: ignore[misc]
        if self.transport.is_closing():
            return
        phase = self._waiting_for()
        if phase != "head":
            self._head_bytes, self._head_tail = 0, b""
        self._arm(phase)

    def eof_received(self) -> bool | None:
        if self._linger is not None:
            return None  # the client has sent all it will: the socket closes
        return super().eof_received()  # type: ignore[misc]

    def on_response_complete(self) -> None:
        answered, queued = self.cycle, bool(getattr(self, "pipeline", None))
        super().on_response_complete()  # type: ignore[misc]
        if queued or self.cycle is not answered:
            # uvicorn started a pipelined request (httptools: from its queue; h11: parsed
            # from its buffer just now), and arms no keep-alive timer: its body, if not all
            # in, gets its deadline from now.
            self._arm(self._waiting_for())
        else:
            self._arm(None)  # idle until the next byte: uvicorn's keep-alive timer

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None)
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _close(self) -> None:
        """uvicorn closes the connection: at once, unless the client is still sending the
        body of the request just answered (see "Lingering close")."""
        cycle, socket = self.cycle, self._socket
        unread = cycle is not None and cycle.more_body and cycle.response_complete
        if self._linger is not None or not unread or not socket.can_write_eof():
            socket.close()  # TLS cannot half-close: it closes at once
            return
        self._arm(None)
        self._linger = self.loop.call_later(LINGER_S, socket.close)
        socket.write_eof()  # after the answer's bytes: the client reads it, then the end
        socket.resume_reading()  # uvicorn may have paused it while the app read the body

    def _expired(self) -> None:
        phase, self._deadline, self._phase = self._waiting_for(), None, None
        if phase is None or self.transport.is_closing():
            return
        field = "head_timeout_s" if phase == "head" else "body_timeout_s"
        seconds = self.head_timeout_s if phase == "head" else self.body_timeout_s
        self._refuse(_408, 408, f"the request's {phase} did not arrive within {field}={seconds:g}")

    def _refuse(self, template: bytes, status: int, message: str) -> None:
        # Written straight to the socket when no response is being sent (the phases say
        # none is; checked again, since bytes of ours inside a response would corrupt it:
        # then the connection only closes), and the connection ends with it, at once (a
        # client too slow for its deadline gets no more time), so the protocol's own state
        # no longer matters. The app, if it waits for the body, sees a disconnect.
        if not self._answering():
            data = error_json(HTTPError(status, None, message))
            self._socket.write(template % (len(data), data))
        self._socket.close()
