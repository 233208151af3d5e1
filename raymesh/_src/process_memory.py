"""Another process's memory, read and written by the kernel on the caller's thread: Linux's
`process_vm_readv` / `process_vm_writev` (cross-memory attach). The other process does nothing:
no thread of it wakes, no message reaches it. This is what makes `RDMABuffer` one-sided on one
host, as an RDMA NIC makes it one-sided across hosts.

Guarantees:
- A `Peer` names one process, not one pid: it holds a pidfd opened while the process's start
  time matched the one recorded with it, so a pid reused by a newer process is never read. Every
  copy ends with a check that the process is still alive; one that died before or during the
  copy raises `PeerGone` (what was copied is then not to be trusted).
- The kernel checks ptrace access (same user, and Yama's `ptrace_scope`): a refused copy raises
  `PermissionError` before any byte moves; the caller falls back to another path.
- Copies go in chunks of `CHUNK_BYTES`, with the deadline checked between chunks: a copy never
  runs more than one chunk past it (`TimeoutError`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import sys
import threading
import time
from collections.abc import Callable

__all__ = [
    "CHUNK_BYTES",
    "Peer",
    "PeerGone",
    "allow_node_readers",
    "host_key",
    "start_time",
    "supported",
]

# One syscall's worth of copying: ~20 ms at memory speed on a small machine, so a deadline or a
# dropped buffer is noticed within that.
CHUNK_BYTES = 64 << 20


class PeerGone(Exception):
    """The process is gone (or its pid now names another process)."""


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_calls() -> tuple[Callable[..., int], Callable[..., int]] | None:
    if sys.platform != "linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    calls = []
    for name in ("process_vm_readv", "process_vm_writev"):
        fn = getattr(libc, name, None)
        if fn is None:
            return None
        fn.restype = ctypes.c_ssize_t
        fn.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.POINTER(_IOVec),
            ctypes.c_ulong,
            ctypes.c_ulong,
        ]
        calls.append(fn)
    return calls[0], calls[1]


_CALLS = _libc_calls()


def supported() -> bool:
    """Whether this platform has cross-memory attach at all (Linux >= 3.2 with pidfds)."""
    return _CALLS is not None and hasattr(os, "pidfd_open")


def host_key() -> str:
    """Two processes with equal keys can reach each other's memory by pid: the same kernel
    (boot id) and the same pid namespace. A Ray node id would not do: two containers on one node
    have a kernel in common but not their pids."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return f"no-proc:{os.getpid()}"  # no procfs: matches only this process


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22), which
    with the pid names one process for the life of the machine; None when there is no such pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: fields after its last ')'.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


class Peer:
    """One other process of this host, by pid and start time (see the module)."""

    def __init__(self, pid: int, started: int) -> None:
        self.pid = pid
        self.started = started
        self._pidfd: int | None = None
        self._lock = threading.Lock()

    def _fd(self) -> int:
        with self._lock:
            if self._pidfd is None:
                try:
                    fd = os.pidfd_open(self.pid)
                except OSError:
                    raise PeerGone(f"process {self.pid} is gone") from None
                # Opened first, checked second: had the pid been reused before the open, the
                # start time now differs; once open, the fd names this process for good.
                if start_time(self.pid) != self.started:
                    os.close(fd)
                    raise PeerGone(f"process {self.pid} is gone (its pid names another now)")
                self._pidfd = fd
            return self._pidfd

    def alive(self) -> bool:
        """False once the process has exited (a zombie counts as exited)."""
        try:
            fd = self._fd()
        except PeerGone:
            return False
        return not select.select([fd], [], [], 0)[0]

    def read(self, local: int, remote: int, n: int, deadline: float | None) -> None:
        """Copy `n` bytes at `remote` in the process to `local` in this one."""
        self._copy(0, local, remote, n, deadline)

    def write(self, remote: int, local: int, n: int, deadline: float | None) -> None:
        """Copy `n` bytes at `local` in this process to `remote` in the process."""
        self._copy(1, local, remote, n, deadline)

    def _copy(self, way: int, local: int, remote: int, n: int, deadline: float | None) -> None:
        if _CALLS is None:
            raise PermissionError("this platform has no process_vm_readv")
        call = _CALLS[way]
        self._fd()  # the process is still the one recorded, or PeerGone
        done = 0
        while done < n:
            if deadline is not None and done and time.monotonic() > deadline:
                raise TimeoutError(f"copied {done} of {n} bytes before the deadline")
            size = min(CHUNK_BYTES, n - done)
            lv, rv = _IOVec(local + done, size), _IOVec(remote + done, size)
            got = call(self.pid, ctypes.byref(lv), 1, ctypes.byref(rv), 1, 0)
            if got <= 0:
                self._raise(ctypes.get_errno(), remote + done)
            done += got
        if not self.alive():  # the pid may have been reused during the copy
            raise PeerGone(f"process {self.pid} exited during the copy")

    def _raise(self, err: int, address: int) -> None:
        if err == errno.ESRCH or not self.alive():
            raise PeerGone(f"process {self.pid} is gone")
        if err == errno.EPERM:
            raise PermissionError(
                f"the kernel refused access to process {self.pid}'s memory (EPERM: another "
                "user's process, or Yama's kernel.yama.ptrace_scope forbids it)"
            )
        raise OSError(err, f"process {self.pid} at 0x{address:x}: {os.strerror(err)}")

    def __del__(self) -> None:
        if self._pidfd is not None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass


def allow_node_readers() -> None:
    """Under Yama's `ptrace_scope` 1 (Ubuntu's default) a process may read only its
    descendants' memory, so procs (siblings under Ray's raylet) could not read each other's
    buffers. A proc that owns a buffer declares its parent, the raylet, as its ptracer: the
    raylet's descendants (this node's Ray workers, this user's) may then read it, no other
    process. Called in procs only (a controller's parent is a shell). Nothing to do under
    scope 0; scopes 2 and 3 forbid it whatever is declared (copies then go through the proc)."""
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope") as f:
            if f.read().strip() != "1":
                return
    except OSError:
        return  # no Yama
    PR_SET_PTRACER = 0x59616D61  # "Yama"
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(os.getppid()), 0, 0, 0)  # refused: the proc path
