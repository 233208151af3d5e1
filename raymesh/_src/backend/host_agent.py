"""The host agent: one small Ray actor per node, the member of a host mesh.

It watches the processes of the procs on its node and records how each one ended. Ray tells the
owner *that* an actor died within milliseconds, but not *how*: its worker processes are children
of the raylet, so only the raylet could read their wait status. The agent opens a pidfd for each
proc; the kernel makes it readable the moment the process exits. Then the wait status (exit
code or signal) comes from the pidfd itself (PIDFD_GET_INFO with PIDFD_INFO_EXIT, Linux >= 6.15,
available once the raylet has reaped the process), or, on older kernels, from the zombie's
`/proc/<pid>/stat` if the agent reads it before the raylet reaps. Where neither works (not
Linux, or the race lost), the cause says the status is unknown.

It also creates what must be owned by the driver rather than by the actor that first asks for it
(the job's registry, see `registry`): the agent of a host where the driver spawned procs is the
driver's (`own`). And it appends the flush barrier's markers to exited procs' log files
(`mark_logs`, see `log_barrier`).
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import ray

from raymesh._src.backend import runtime, runtime_file


def _read_wait_status(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    # Field 52 (exit_code, Linux >= 3.5) is the last; it is only meaningful for a zombie.
    if not fields or fields[0] != "Z":
        return None
    return int(fields[-1])


# struct pidfd_info (linux/pidfd.h), version 0: 64 bytes; exit_code is the s32 at offset 60.
_PIDFD_INFO_SIZE = 64
_PIDFD_GET_INFO = (3 << 30) | (_PIDFD_INFO_SIZE << 16) | (0xFF << 8) | 11  # _IOWR(0xFF, 11, ...)
_PIDFD_INFO_EXIT = 1 << 3


def _pidfd_exit_status(fd: int) -> int | None:
    buf = bytearray(_PIDFD_INFO_SIZE)
    struct.pack_into("Q", buf, 0, _PIDFD_INFO_EXIT)
    try:
        fcntl.ioctl(fd, _PIDFD_GET_INFO, buf)
    except OSError:
        return None
    mask = struct.unpack_from("Q", buf, 0)[0]
    if not mask & _PIDFD_INFO_EXIT:
        return None  # not reaped yet, or a kernel without exit info
    return struct.unpack_from("i", buf, 60)[0]


def _exit_status(fd: int, pid: int) -> int | None:
    """The wait status of the exited process behind `fd`, by whichever route works first."""
    deadline = time.monotonic() + 1.0
    while True:
        status = _read_wait_status(pid)
        if status is None:
            status = _pidfd_exit_status(fd)
        if status is not None or time.monotonic() > deadline:
            return status
        time.sleep(0.005)  # a zombie the raylet has not reaped yet: the pidfd info follows


def describe_status(status: int | None) -> dict[str, Any]:
    if status is None:
        return {"exit_code": None, "signal": None, "cause": "the process exited (status unknown)"}
    if status & 0x7F:
        sig = status & 0x7F
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return {"exit_code": None, "signal": sig, "cause": f"killed by {name}"}
    code = (status >> 8) & 0xFF
    return {"exit_code": code, "signal": None, "cause": f"exited with code {code}"}


class _HostAgent:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._fds: dict[int, int] = {}  # pidfd -> pid
        self._exits: dict[int, dict[str, Any]] = {}
        self._poll = select.poll()
        self._wake_r, self._wake_w = os.pipe()
        self._poll.register(self._wake_r, select.POLLIN)
        threading.Thread(target=self._loop, name="raymesh-deathwatch", daemon=True).start()

    def __repr__(self) -> str:
        return "raymesh-host"

    def watch(self, pids: list[int]) -> None:
        """Start watching `pids` (proc processes on this node)."""
        for pid in pids:
            with self._lock:  # an earlier process with this pid (pids wrap) ended long ago
                self._exits.pop(pid, None)
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):
                # Already gone, or no pidfds here: record what can be known now.
                with self._lock:
                    self._exits.setdefault(pid, describe_status(_read_wait_status(pid)))
                    self._lock.notify_all()
                continue
            with self._lock:
                self._fds[fd] = pid
                self._poll.register(fd, select.POLLIN)
        os.write(self._wake_w, b"x")

    def exit_status(self, pid: int, timeout: float) -> dict[str, Any] | None:
        """How `pid` ended; waits up to `timeout` for it to end. None if it is still running."""
        with self._lock:
            self._lock.wait_for(lambda: pid in self._exits, timeout=timeout)
            return self._exits.get(pid)

    def wait_exited(self, pids: list[int], timeout: float) -> list[int]:
        """Wait until every pid has exited (or `timeout`); return those still running."""
        deadline = time.monotonic() + timeout
        alive = [p for p in pids if _is_running(p)]
        while alive and time.monotonic() < deadline:
            time.sleep(0.02)
            alive = [p for p in alive if _is_running(p)]
        return alive

    def kill(self, pid: int) -> None:
        """SIGKILL `pid` (a proc on this node) if it still runs."""
        if _is_running(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def wait_idle(self, cores: float, seconds: float, timeout: float) -> bool:
        """`wait_idle` (below), on this agent's host."""
        return wait_idle(cores, seconds, timeout)

    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "hostname": os.uname().nodename}

    def mark_logs(self, files: dict[int, list[str]], line: str) -> list[int]:
        """Append `line` to each exited proc's log files (pid -> its stdout and stderr files):
        the flush barrier's marker, after every byte the proc wrote (see `log_barrier`).
        Returns the pids whose files all took it. A file is never created: one Ray moved
        away is no longer tailed, and a proc still running is skipped (what it writes next
        would follow the marker)."""
        done = []
        for pid, paths in files.items():
            if not _is_running(pid) and all(_append(path, line) for path in paths):
                done.append(pid)
        return done

    def own(self, make: Callable[..., Any], *args: Any) -> Any:
        """`make(*args)`, run here: the actors it creates are this agent's, and so live as
        long as whoever created the agent (the driver, on a host where it spawned procs)."""
        return make(*args)

    def _loop(self) -> None:
        while True:
            for fd, _ in self._poll.poll():
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    pid = self._fds.pop(fd, None)
                    self._poll.unregister(fd)
                if pid is None:
                    continue
                status = _exit_status(fd, pid)
                os.close(fd)
                with self._lock:
                    self._exits[pid] = describe_status(status)
                    while len(self._exits) > _EXITS_KEPT:  # a runtime's agent lives for days
                        del self._exits[next(iter(self._exits))]
                    self._lock.notify_all()


_EXITS_KEPT = 100_000  # how many ended procs an agent remembers how they ended, newest first

# Warm procs are refilled on a host once it has had a core idle for 2 s in a row (not in the gap
# between two jobs), or after 60 s anyway: warm procs starting beside a job's ranks (Ray's worker
# start, then imports) cut a 2-rank CPU job's steps/s by a quarter to a half here.
REFILL_IDLE = (1.0, 2.0)  # (cores, seconds)
REFILL_WAIT_S = 60.0


def wait_idle(cores: float, seconds: float, timeout: float) -> bool:
    """Return once this host has had `cores` CPUs idle for `seconds` in a row (True), or after
    `timeout` seconds (False)."""
    deadline = time.monotonic() + timeout
    before, idle_since = _cpu_times(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = _cpu_times()
        total = sum(now) - sum(before)
        idle = (now[3] + now[4]) - (before[3] + before[4])  # idle + iowait
        if total > 0 and idle / total * (os.cpu_count() or 1) < cores:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since >= seconds:
            return True
        before = now
    return False


# Ray's stubs omit actor options such as max_concurrency.
HostAgent: Any = ray.remote(num_cpus=0, max_concurrency=64)(_HostAgent)  # type: ignore[call-overload]
_agents: dict[str, Any] = {}  # node id -> the agent that watches procs there
_own_agents: dict[str, Any] = {}  # node id -> this job's own agent there
_agents_lock = threading.Lock()
PREFIX = "raymesh-host"


def host_agent(node_id: str) -> Any:
    """The agent that watches procs on a node: on a local runtime (`raymesh up`) the
    runtime's, which its programs share (it starts with the runtime, so no program waits for
    one to start); elsewhere this job's own (`own_agent`)."""
    with _agents_lock:
        agent = _agents.get(node_id)
    if agent is None:
        try:
            agent = ray.get_actor(
                runtime.node_actor_name(PREFIX, node_id), namespace=runtime_file.NAMESPACE
            )
        except ValueError:  # not a local runtime's node
            agent = own_agent(node_id)
        with _agents_lock:
            agent = _agents.setdefault(node_id, agent)
    return agent


def runtime_agent(node_id: str) -> Any:
    """The local runtime's agent of its node, which its daemon starts and holds."""
    return runtime.node_actor(
        HostAgent, PREFIX, node_id, _agents, _agents_lock, namespace=runtime_file.NAMESPACE
    )


def own_agent(node_id: str) -> Any:
    """This job's agent of a node, created on first use (see `runtime.node_actor`): what it
    creates (`own`) lives as long as the job's driver, where the driver asked for it first."""
    return runtime.node_actor(HostAgent, PREFIX, node_id, _own_agents, _agents_lock)


def _cpu_times() -> list[int]:
    """The host's CPU time counters (user, nice, system, idle, iowait, ...) from /proc/stat."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:]]


def _append(path: str, line: str) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError:
        return False
    try:
        return os.write(fd, line.encode()) == len(line.encode())
    except OSError:
        return False
    finally:
        os.close(fd)


def _is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2 :].split()[0] not in ("Z", "X")
