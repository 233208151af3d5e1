"""The Unix sockets of channels: the private directory they live in (see `channel`'s
guarantees), a process's addresses, its listening and sending sockets, and the sweep of
sockets that dead processes left.
"""

from __future__ import annotations

import atexit
import os
import stat
import tempfile
import threading
import uuid

import zmq

__all__ = ["listen", "new_address", "push", "socket_dir", "unlink"]

_LINGER_MS = 60_000  # how long a closed socket keeps trying to deliver what it has queued


def socket_dir() -> str:
    """Where this user's procs put their sockets (see the module's guarantees):
    `$XDG_RUNTIME_DIR/raymesh` where the login manager gave this user such a directory, else
    `raymesh-<uid>` in the temp dir. Made with mode 0700 in one step (mkdir), then checked
    without following links: PermissionError, naming the path and the fix, when it is a
    symbolic link, not a directory, not this user's, or open to its group or others. Once
    checked it cannot be swapped: both parents let only its owner rename or remove it (the
    temp dir is sticky)."""
    path = _socket_path()
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = f"is a symbolic link (to {os.readlink(path)!r})"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "is not a directory"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    elif st.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(st.st_mode):04o}: its group or others may enter it"
    if problem is not None:
        raise PermissionError(
            f"the channel socket directory {path} {problem}; procs read messages from the "
            "sockets in it, so it must be a directory of this user's with mode 0700: remove "
            "it (raymesh makes it anew), or set RAYMESH_CHANNELS=0 to send every message "
            "through Ray"
        )
    if path not in _swept:
        _swept.add(path)
        _sweep(path)
    return path


_swept: set[str] = set()


def _socket_path() -> str:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(runtime):
        try:
            st = os.stat(runtime)
        except OSError:
            st = None  # set but gone (a login's variable kept across `su`, say)
        # Only a directory of this user's that no one else may write to, as logind makes it.
        if st and stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022:
            return os.path.join(runtime, "raymesh")
    return os.path.join(tempfile.gettempdir(), f"raymesh-{os.getuid()}")


def new_address(role: str) -> str:
    """A new socket address for this process in `role` ("proc", "caller"): unique to the
    process, not just its pid, because pids wrap and the other end remembers addresses (a caller
    refuses those of dead procs; a proc keeps a socket per caller it has replied to)."""
    name = f"{role}-{os.getpid()}-{uuid.uuid4().hex[:12]}.sock"
    return f"ipc://{os.path.join(socket_dir(), name)}"


def listen(ctx: zmq.Context, address: str) -> zmq.Socket:
    """A socket receiving at `address`, whose file goes with this process."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    atexit.register(unlink, address)
    return sock


def unlink(address: str) -> None:
    try:
        os.unlink(address.removeprefix("ipc://"))
    except OSError:
        pass


def _sweep(path: str) -> None:
    """Remove the sockets of processes that are gone (a SIGKILLed proc leaves its file)."""
    for name in os.listdir(path):
        pid = name.split("-")[1].split(".")[0] if name.count("-") else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            unlink(os.path.join(path, name))


def push(local: threading.local, ctx: zmq.Context, address: bytes) -> zmq.Socket:
    """This thread's sending socket to `address` (ZeroMQ sockets are single-threaded, so each
    thread sends on its own: no lock, no hand-off to another thread)."""
    pushes = local.__dict__.setdefault("pushes", {})
    sock = pushes.get(address)
    if sock is None:
        sock = pushes[address] = ctx.socket(zmq.PUSH)
        # When the thread ends, its sockets close with it: what is still queued (the connection
        # may not even be up yet) must still go out, or the proc waits for a lost message.
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        sock.setsockopt(zmq.SNDHWM, 0)  # queue like Ray does; never block a sender
        sock.setsockopt(zmq.RECONNECT_IVL, -1)  # the other end never comes back
        sock.connect(address.decode())
    return sock
