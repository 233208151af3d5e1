"""The wire between a paused actor's pdb and a debugger client: a loopback TCP socket, one
client at a time, that must first give the token.

The protocol, both ways UTF-8 text:
- the client sends its token as one line; the actor answers `ok` or `refused: <why>` (a wrong
  token, or another client already attached) and then closes;
- then pdb's output flows to the client as it is written, and `PROMPT_MARK` (a NUL) each time
  pdb waits for a command; the client sends commands, one a line;
- a client line that starts with `CONTROL` (a NUL) is for the wire, not for pdb:
  `CONTROL + "detach"` leaves the actor paused and frees it for the next client;
- a client that goes without detaching (its connection closed, its process killed) resumes
  the actor, as pdb's `continue` would: nobody is left to drive it;
- when pdb resumes the actor (`c`, the endpoint returning), the actor closes the connection.
"""

from __future__ import annotations

import hmac
import queue
import secrets
import socket
import threading
from collections.abc import Callable

__all__ = ["CONTROL", "DETACH", "PROMPT_MARK", "Wire"]

PROMPT_MARK = "\x00"
CONTROL = "\x00"
DETACH = CONTROL + "detach"
_TOKEN_TIMEOUT_S = 5.0  # a client that does not give its token within this is dropped
_MAX_LINE = 64 * 1024
_POLL_S = 0.5  # how often a waiting pdb looks whether its actor is being stopped


class Wire:
    """pdb's stdin and stdout (`readline`, `write`, `flush`), served on 127.0.0.1.

    `on_attach()` runs on pdb's thread when a client attaches (it prints where pdb is);
    `port` is where to connect; `token` what to send first. `close()` ends it: the client is
    disconnected and no other is accepted."""

    def __init__(self, on_attach: Callable[[], None]) -> None:
        self.token = secrets.token_urlsafe(32)
        self._on_attach = on_attach
        self._server = socket.create_server(("127.0.0.1", 0), backlog=8)
        self._server.settimeout(_POLL_S)
        self.port: int = self._server.getsockname()[1]
        self._lock = threading.Lock()
        # The attached client, which pdb's output goes to; the one greeted but not yet attached
        # (pdb's thread attaches it, so that its first output is where pdb stands, whole).
        self._client: socket.socket | None = None
        self._pending: socket.socket | None = None
        self._events: queue.SimpleQueue[tuple[str, socket.socket | None, str]] = queue.SimpleQueue()
        self._closed = False
        self._quit = False
        threading.Thread(target=self._accept, name="raymesh-debug-accept", daemon=True).start()

    # ---- pdb's side -----------------------------------------------------------------------
    def write(self, text: str) -> int:
        with self._lock:
            client = self._client
        if client is not None:
            try:
                client.sendall(text.encode("utf-8", "replace"))
            except OSError:
                pass  # gone: its reader reports it
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        """The next command for pdb: a line from the attached client, once there is one.
        `continue` when the client goes without detaching, `quit` when the actor is stopped."""
        self._send_mark()
        while True:
            if self._quit:
                return "quit\n"
            try:
                kind, client, text = self._events.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            with self._lock:
                if kind == "attach" and client is not None and client is self._pending:
                    self._client, self._pending = client, None
                current = client is not None and client is self._client
                if current and kind in ("detach", "eof"):
                    self._client = None
            if not current or client is None:
                continue  # from a client already gone, or the quit wake-up
            if kind == "attach":
                self._on_attach()
                self._send_mark()
            elif kind == "line":
                return text + "\n"
            elif kind == "detach":
                _close(client)
            else:  # eof: the client went without detaching
                _close(client)
                return "continue\n"

    def quit(self) -> None:
        """Make pdb quit at its next command (its actor is being stopped)."""
        self._quit = True
        self._events.put(("quit", None, ""))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients = (self._client, self._pending)
            self._client = self._pending = None
        _close(self._server)
        for client in clients:
            if client is not None:
                _close(client)

    def _send_mark(self) -> None:
        self.write(PROMPT_MARK)

    # ---- the clients' side ----------------------------------------------------------------
    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            threading.Thread(
                target=self._greet, args=(conn,), name="raymesh-debug-client", daemon=True
            ).start()

    def _greet(self, conn: socket.socket) -> None:
        """Check the client's token and make it the attached client, or refuse it."""
        conn.settimeout(_TOKEN_TIMEOUT_S)
        reader = _Lines(conn)
        try:
            given = reader.line()
        except (OSError, ValueError):
            given = None
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            _refuse(conn, "wrong token")
            return
        with self._lock:
            busy = self._client is not None or self._pending is not None
            if self._closed:
                why: str | None = "the actor resumed"
            elif busy:
                why = "another client is attached to this actor (it must detach first)"
            else:
                why = None
                try:
                    conn.sendall(b"ok\n")
                except OSError:
                    pass
                conn.settimeout(None)
                self._pending = conn
        if why is not None:
            _refuse(conn, why)
            return
        self._events.put(("attach", conn, ""))
        while True:
            try:
                line = reader.line()
            except (OSError, ValueError):
                line = None
            if line is None:
                self._events.put(("eof", conn, ""))
                return
            if line.startswith(CONTROL):
                if line == DETACH:
                    self._events.put(("detach", conn, ""))
                    return
                continue  # an unknown control line: ignored
            self._events.put(("line", conn, line))


class _Lines:
    """Lines read from a socket, each at most `_MAX_LINE` bytes (ValueError past that)."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self._buf = b""

    def line(self) -> str | None:
        """The next line without its newline; None at the end of the stream."""
        while b"\n" not in self._buf:
            if len(self._buf) > _MAX_LINE:
                raise ValueError("line too long")
            chunk = self._conn.recv(4096)
            if not chunk:
                return None
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode("utf-8", "replace").rstrip("\r")


def _refuse(conn: socket.socket, why: str) -> None:
    try:
        conn.sendall(f"refused: {why}\n".encode())
    except OSError:
        pass
    _close(conn)


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        conn.close()
    except OSError:
        pass
