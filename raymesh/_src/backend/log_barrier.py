"""The flush barrier: once a stopped mesh's procs have exited, `flush` waits (bounded) until
every line they wrote has been printed by this process, as Monarch's log forwarding flushes
before `stop()` returns.

How a proc's output reaches the controller: Ray's log monitor (one process per node) tails each
worker's stdout and stderr files (`logs/worker-...-<pid>.out` and `.err`) and publishes their
lines; the driver's logger thread prints them. Nothing on that path says when a proc's last
line has been printed, so without a barrier `stop()` returns with the tail of a proc's output
(what its `__cleanup__`, `atexit` handlers and threads wrote last) still in flight: printed
after lines the program prints next, or never, if the program exits first.

The barrier, in three places:
- a proc says, as it starts, which files its descriptors 1 and 2 write (`worker_log_files`);
- once the proc has exited (its descriptors closed: nothing it runs can write any more), the
  host agent of its node appends a marker line carrying a random token to both files
  (`HostAgent.mark_logs`), after every byte the proc wrote, to be tailed like the rest;
- this process's hook on Ray's printing (`Barrier.handler`) prints the lines before a marker,
  flushes its own stdout or stderr, then counts the marker (never printed); `flush` returns
  once every marker is in, or after its timeout, naming the procs whose output may be short.

The token is made per stop and written by the agent, never sent to the proc, so nothing a proc
prints can end the wait early; a marker counts only from the file of the proc it was written
for (Ray names the file's pid with each line). A proc that died earlier, even by SIGKILL, is
flushed the same way: its files are complete. What no marker can cover: a proc on a node that
is gone (its log monitor went with it), a log file Ray moved away (its log monitor does once
it tails too many files), and lines a proc's child process writes to the inherited files after
the proc has exited.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import ray

from raymesh._src.backend import runtime
from raymesh._src.backend.host_agent import host_agent

__all__ = ["Barrier", "flush", "worker_log_files"]

logger = logging.getLogger("raymesh")

MARK = ":raymesh_output_end:"  # then the token; like Ray's own `:actor_name:` lines
_MARKER = re.compile(re.escape(MARK) + r"([0-9a-f]{32})$")
_RAY_HANDLER = "ray_print_logs"  # Ray's handler that prints workers' lines in the driver

Key = tuple[str, bool]  # (proc pid, is stderr): one log file; Ray sends the pid as text


def worker_log_files() -> tuple[str, str] | None:
    """The files this process's stdout and stderr (descriptors 1 and 2) write: in a Ray worker,
    the files Ray's log monitor forwards to the driver. None where either is not a regular file
    or /proc cannot say (then the barrier skips this proc)."""
    paths = []
    for fd in (1, 2):
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            paths.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return None
    return paths[0], paths[1]


class Barrier:
    """The markers this process waits for, and the hook that sees them arrive."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._awaited: dict[Key, str] = {}  # log file -> the token its marker must carry

    def expect(self, keys: Iterable[Key], token: str) -> None:
        with self._cond:
            for key in keys:
                self._awaited[key] = token

    def drop(self, keys: Iterable[Key], token: str) -> None:
        """Stop waiting for these markers (no longer coming, or the wait is over)."""
        with self._cond:
            for key in keys:
                if self._awaited.get(key) == token:
                    del self._awaited[key]

    def wait(self, keys: Sequence[Key], token: str, timeout: float) -> list[Key]:
        """Wait until every marker of `keys` has arrived, at most `timeout` seconds; return
        those that did not (they are no longer awaited)."""

        with self._cond:
            self._cond.wait_for(lambda: not self.pending(keys, token), timeout=max(0.0, timeout))
            missing = self.pending(keys, token)
        self.drop(missing, token)
        return missing

    def pending(self, keys: Sequence[Key], token: str) -> list[Key]:
        """Those of `keys` whose marker with `token` is still awaited."""
        with self._cond:
            return [k for k in keys if self._awaited.get(k) == token]

    def handler(self, print_batch: Callable[[dict], Any]) -> Callable[[dict], None]:
        """Ray's handler `print_batch` (one batch of lines of one log file), with markers taken
        out: the lines before a marker are printed first, then the marker counts."""

        def handle(data: dict) -> None:
            lines = data.get("lines") or []
            if not any(MARK in line for line in lines):
                print_batch(data)
                return
            kept: list[str] = []
            for line in lines:
                found = _MARKER.search(line)
                if found is None:
                    kept.append(line)
                    continue
                if found.start():  # a last line written without its newline
                    kept.append(line[: found.start()])
                if kept:
                    print_batch(dict(data, lines=kept))
                    kept = []
                self._arrived(data, found.group(1))
            if kept:
                print_batch(dict(data, lines=kept))

        handle.raymesh_barrier = True  # type: ignore[attr-defined]
        return handle

    def _arrived(self, data: dict, token: str) -> None:
        key: Key = (str(data.get("pid")), bool(data.get("is_err")))
        with self._cond:
            if self._awaited.get(key) != token:  # another stop's, or another process's
                return
            sink = sys.stderr if key[1] else sys.stdout
            try:
                sink.flush()  # printed means written out, even if the program exits next
            except Exception:  # a closed or replaced stream: nothing more to do for it
                pass
            del self._awaited[key]
            self._cond.notify_all()


_barrier = Barrier()


def _install() -> bool:
    """Put the barrier's hook around Ray's handler that prints workers' output here. False
    where there is none: Ray does not print procs' output in this process (a Ray worker, such
    as an actor that owns a mesh; or `log_to_driver=False`), so there is nothing to wait for.
    Ray adds its handler at each `ray.init`, so this looks again at every flush. (Ray's
    `print_to_stdstream` itself is looked up once, at `ray.init`: replacing it afterwards, as
    `ray_output` does for the raylet's messages, does not reach workers' lines.)"""
    from ray._private import ray_logging

    dispatcher = getattr(ray_logging, "global_worker_stdstream_dispatcher", None)
    lock = getattr(dispatcher, "_lock", None)
    if dispatcher is None or lock is None:  # a Ray release that prints otherwise: no barrier
        return False
    with lock:
        for i, (name, handle) in enumerate(dispatcher.handlers):
            if name == _RAY_HANDLER:
                if not getattr(handle, "raymesh_barrier", False):
                    dispatcher.handlers[i] = (name, _barrier.handler(handle))
                return True
    return False


def flush(procs: Sequence[Any], timeout: float) -> dict[int, str]:
    """Wait until every line the `procs` (`RayProc`s, all exited) wrote has been printed here,
    at most `timeout` seconds. Returns, for each proc whose output may be incomplete, its index
    in `procs` and why; {} at once where this process prints no procs' output, or for a
    timeout of 0. Procs whose log files are unknown (`worker_log_files`) are not waited for."""
    if timeout <= 0 or not ray.is_initialized() or not _install():
        return {}
    deadline = time.monotonic() + timeout
    token = secrets.token_hex(16)
    alive = {n.node_id for n in runtime.nodes()}
    known = {i: p for i, p in enumerate(procs) if p.logs and p.pid > 0}
    why = {i: "its node is gone" for i, p in known.items() if p.node_id not in alive}
    waited = {i: p for i, p in known.items() if i not in why}
    keys = {i: [(str(p.pid), False), (str(p.pid), True)] for i, p in waited.items()}
    everyone = [k for ks in keys.values() for k in ks]
    _barrier.expect(everyone, token)
    try:
        marked = _mark(waited, MARK + token + "\n", deadline)
        for i, p in waited.items():
            if p.pid not in marked:
                why[i] = "its log files could not be marked (Ray moved them, or its agent failed)"
        waiting = [k for i, ks in keys.items() if i not in why for k in ks]
        missing = set(_barrier.wait(waiting, token, deadline - time.monotonic()))
    finally:
        _barrier.drop(everyone, token)
    for i, ks in keys.items():
        if missing.intersection(ks):
            why[i] = f"its last lines did not arrive within {timeout:g}s"
    return dict(sorted(why.items()))


def _mark(procs: dict[int, Any], line: str, deadline: float) -> set[int]:
    """Have each node's agent append `line` to its exited procs' log files; the pids done."""
    by_node: dict[str, dict[int, list[str]]] = {}
    for p in procs.values():
        by_node.setdefault(p.node_id, {})[p.pid] = list(p.logs)
    refs = []
    for node, files in by_node.items():
        try:
            refs.append(host_agent(node).mark_logs.remote(files, line))
        except Exception:  # an agent from before the barrier (a long-lived local runtime's)
            logger.debug("raymesh: no agent marks log files on %s", node, exc_info=True)
    marked: set[int] = set()
    for ref in refs:
        try:
            marked.update(ray.get(ref, timeout=max(0.1, deadline - time.monotonic())))
        except Exception:  # a gone agent: its procs are reported, not waited for
            logger.debug("raymesh: marking procs' log files failed", exc_info=True)
    return marked
