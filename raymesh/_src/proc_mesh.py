"""Proc meshes: processes over named axes, where actors run; their creation and their end.

- `ProcMesh.spawn(name, Actor, ...)`: one actor per proc, constructed before `spawn` returns.
- `create_proc_mesh`: the procs a host mesh asked for (raymesh._src.host_mesh decides which
  and where), started through the backend and owned by the calling process.

A proc mesh belongs to the process that spawned it: that process's supervisor watches it, and it
ends with that process (Ray ends non-detached actors with their owner). Copies sent to other
actors are references: they can spawn and call, but do not own. `shutdown_context()` stops
every mesh this process owns, and at exit the backend stops them before Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
import weakref
from typing import Any, TypeVar

from raymesh._src import backend, ownership
from raymesh._src.context import current_actor_context
from raymesh._src.errors import MeshFailure
from raymesh._src.future import Future
from raymesh._src.mesh_state import ProcMeshState
from raymesh._src.proc import start_proc_runtime
from raymesh._src.shape import Extent, MeshTrait, Shape

logger = logging.getLogger("raymesh")

T = TypeVar("T")

__all__ = [
    "ProcMesh",
    "create_proc_mesh",
    "owner_key",
    "preload",
    "proc_resources",
    "shutdown_context",
]

_STOP_TIMEOUT_S = 30.0
# How long a stopped proc gets to exit as Python exits (its finalizers, `atexit`) once its
# actors have stopped, before it is killed.
_GRACE_S = 5.0
# How long stop() waits, once the procs have exited, for the last lines they wrote to be
# printed here (the flush barrier, `backend.flush_output`); `RAYMESH_LOG_FLUSH_S` sets it.
_LOG_FLUSH_S = 5.0


def proc_resources(cpus_per_proc: float, gpu: bool) -> dict[str, float]:
    """What one proc reserves (a proc with no CPU still holds a sliver, so Ray places it)."""
    res = {"CPU": float(cpus_per_proc), "GPU": 1.0 if gpu else 0.0}
    return {k: v for k, v in res.items() if v > 0} or {"CPU": 0.001}


def create_proc_mesh(
    extent: Extent,
    node_ids: list[str],
    name: str | None,
    cpus_per_proc: float,
    gpu: bool,
    timeout: float,
    asked: str,
    escalate: bool,
) -> ProcMesh:
    """One proc per point of `extent`, the i-th on `node_ids[i]`, owned by this process."""
    resources = proc_resources(cpus_per_proc, gpu)
    mesh_name = name or f"procs{uuid.uuid4().hex[:6]}"
    points = list(extent.points())
    group = backend.create_procs(
        mesh_name, points, node_ids, resources, timeout, asked, start_runtime=start_proc_runtime
    )
    state = ProcMeshState(mesh_name, group.procs, group, owner_key(), handled_by_owner=not escalate)
    _own(state)
    return ProcMesh(state, Shape.of(dict(extent)))


def preload(*modules: str) -> None:
    """Have warm procs import `modules` while they wait, so that a proc adopted from the pool
    already has them (see docs/programming-model.md, "Warm procs"). For imports that cost
    seconds and that most procs of the program make: a model library, a tokenizer. Applies to
    warm procs started from now on; a module that fails to import there is skipped (it fails
    again, visibly, where the proc imports it)."""
    for m in modules:
        if not backend.is_module_name(m):
            raise ValueError(
                f"preload({m!r}): give dotted module names as strings, e.g. "
                "preload('transformers', 'my_project.model')"
            )
    backend.preload(modules)


def owner_key() -> str | None:
    """The actor that owns a mesh spawned here now (None: the controller, which owns it)."""
    ctx = current_actor_context()
    return ctx.actor_key if ctx is not None else None


_owned: weakref.WeakSet[ProcMeshState] = weakref.WeakSet()


def _own(state: ProcMeshState) -> None:
    from raymesh._src.supervision import supervisor

    _owned.add(state)
    ownership.own(state.owner_key, state, state.name, lambda: _stop(state, wait=True))
    supervisor().watch(state)


def shutdown_context() -> Future[None]:
    """Monarch's: end this process's raymesh resources. Stops every proc mesh it owns (their
    actors' `__cleanup__` runs, each proc ends and is waited for, and its output printed, as in
    `ProcMesh.stop`), then in the controller
    disconnects from Ray if raymesh connected (the local Ray raymesh started stops with it; a
    `ray.init` of the user's own is left as it is). Idempotent; a later spawn connects again.
    Returns a resolved Future (it has waited). With the local runtime this program attached to
    gone (`RuntimeLostError`), there is nothing left to stop: it returns at once."""
    from raymesh._src.proc import current_runtime

    flush_s = log_flush_s()
    if backend.runtime_lost():
        return Future.resolved(None, "shutdown_context")
    for state in list(_owned):
        try:
            _stop(state, wait=True, flush_s=flush_s)
        except Exception:
            logger.warning("raymesh: stopping %r at shutdown failed", state.name, exc_info=True)
    if current_runtime() is None and backend.connected():
        backend.shutdown()
    return Future.resolved(None, "shutdown_context")


def _stop_owned() -> None:
    for state in list(_owned):
        try:
            _stop(state, wait=False)
        except Exception:
            pass


backend.before_shutdown(_stop_owned)  # at exit, too: the procs of a remote cluster stay up


def log_flush_s() -> float:
    """The flush barrier's bound, from `RAYMESH_LOG_FLUSH_S` (default 5 s; 0 turns it off)."""
    raw = os.environ.get("RAYMESH_LOG_FLUSH_S")
    if raw is None:
        return _LOG_FLUSH_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise ValueError(
            f"RAYMESH_LOG_FLUSH_S={raw!r}: give the seconds stop() waits for the last lines of "
            f"its procs' output, a number >= 0 (0: no wait; unset: {_LOG_FLUSH_S:g})"
        )
    return value


def _stop(
    state: ProcMeshState, *, wait: bool, timeout: float = _STOP_TIMEOUT_S, flush_s: float = 0.0
) -> None:
    with state.lock:
        if state.stopped:
            return
        state.stopped = True
    from raymesh._src.supervision import supervisor

    supervisor().forget(state)
    ownership.disown(state.owner_key, state)
    if state.group is None:
        return
    if wait:  # the actors stop first: their __cleanup__ runs, the meshes they own stop; then
        _stop_actors(state, timeout)  # each proc exits gracefully, as in Monarch
        backend.end(state.group, min(_GRACE_S, timeout / 3))
    else:
        backend.kill(state.group)
    if wait:
        alive = backend.wait_exited(state.group.procs, timeout)
        if alive:
            raise TimeoutError(f"procs {alive} of mesh {state.name!r} still run after {timeout}s")
        _flush_output(state, min(flush_s, timeout))


def _flush_output(state: ProcMeshState, timeout: float) -> None:
    """Return once every line the mesh's procs wrote has been printed here (the flush barrier),
    or after `timeout` seconds with one line naming the ranks whose output may be incomplete."""
    try:
        incomplete = backend.flush_output(state.group.procs, timeout)
    except Exception:  # the procs have ended all the same: stop() has done its part
        logger.warning("raymesh: flushing the output of mesh %r failed", state.name, exc_info=True)
        return
    by_reason: dict[str, list[int]] = {}
    for rank, why in incomplete.items():
        by_reason.setdefault(why, []).append(rank)
    if by_reason:
        logger.warning(
            "raymesh: the output of mesh %r may be incomplete: %s",
            state.name,
            "; ".join(
                f"rank{'s' * (len(r) > 1)} {', '.join(map(str, r))}: {why}"
                for why, r in by_reason.items()
            ),
        )


def _stop_actors(state: ProcMeshState, timeout: float) -> None:
    """Stop the actors of the procs still running (not dead, not killed), in parallel, waiting
    at most `timeout`: a proc that does not answer is ended anyway."""
    with state.lock:
        skip = set(state.dead) | state.killed
    refs = [p.stop_all(timeout / 3) for r, p in enumerate(state.procs) if r not in skip]
    if refs:
        backend.wait(refs, len(refs), timeout)


class ProcMesh(MeshTrait):
    """Processes over named axes. Slicing gives a view of the same processes."""

    def __init__(self, state: ProcMeshState, shape: Shape) -> None:
        self._state = state
        self._shape = shape

    @property
    def name(self) -> str:
        return self._state.name

    def _new_with_shape(self, shape: Shape) -> ProcMesh:
        return ProcMesh(self._state, shape)

    @property
    def pids(self) -> list[int]:
        """The process ids of the procs, in this view's order (for tests and tools)."""
        return [self._state.procs[r].pid for r in self._shape.ranks]

    @property
    def node_ids(self) -> list[str]:
        """The Ray node id each proc runs on, in this view's order."""
        return [self._state.procs[r].node_id for r in self._shape.ranks]

    @property
    def failure(self) -> MeshFailure | None:
        """How this view failed: a proc of it died (the first one known), or the mesh was
        stopped; None while supervision knows of no failure. Reads what this process has
        recorded and sends nothing, so it costs no round trip. In the owner, a death shows up
        here as soon as the supervisor sees it (milliseconds), with or without `escalate`; a
        reference in another process learns of one only through its own failed calls. A slice
        that avoids the dead procs reports None, as calls to it still go through. Failures of
        single actors (an unhandled broadcast error) are the actor mesh's, not reported here.
        """
        error = self._state.check(self._shape.ranks, None)
        return error.failure if error is not None else None

    def spawn(self, name: str, cls: type[T], *args: Any, **kwargs: Any) -> Any:
        """Construct `cls(*args, **kwargs)` on every proc; returns the `ActorMesh`.

        Waits for every constructor; one that raises fails the spawn with `ActorError`.
        """
        from raymesh._src.actor_mesh import spawn_actors

        return spawn_actors(self, name, cls, args, kwargs)

    def kill(self) -> None:
        """SIGKILL the procs of this view now, without waiting for what they run: for an
        owner that gives up on a hung proc. `stop()` then releases their resources; calls on
        their actors fail with SupervisionError."""
        if not self._state.owned:
            raise RuntimeError(f"only the owner of mesh {self.name!r} can kill it")
        with self._state.lock:
            self._state.killed.update(self._shape.ranks)  # stop() will not wait for them
        for r in self._shape.ranks:
            proc = self._state.procs[r]
            try:
                backend.kill_pid(proc.node_id, proc.pid)
            except Exception:  # its node may be gone, with the process
                logger.debug("raymesh: killing %s rank %d failed", self.name, r, exc_info=True)

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> Future[None]:
        """End every proc of this mesh (all of it, even when called on a slice) and wait until
        the processes are gone; returns a resolved Future (as Monarch's `stop()` returns one:
        `await procs.stop()` works too). Later calls on its actors raise SupervisionError.

        In the controller, it returns once every line the procs wrote (their `__cleanup__`,
        their `atexit` handlers, their threads until the end) has been printed here, after
        what they printed before: the flush barrier, bounded by `RAYMESH_LOG_FLUSH_S` (default
        5 s; 0: no wait), past which one warning names the ranks whose output may be cut."""
        if not self._state.owned:
            raise RuntimeError(f"only the owner of mesh {self.name!r} can stop it")
        _stop(self._state, wait=True, timeout=timeout, flush_s=log_flush_s())
        return Future.resolved(None, f"stop of {self.name!r}")

    async def logging_option(
        self,
        stream_to_client: bool = True,
        aggregate_window_sec: int | None = 3,
        level: int = logging.INFO,
    ) -> None:
        """Monarch's: where this view's procs send their output, and their log level (await
        it, or `asyncio.run(procs.logging_option(...))`). `stream_to_client=False` sends each
        proc's stdout/stderr to a file of its own (see `raymesh._src.logs.log_path`) instead of
        the controller's console; `level` sets the procs' root logger level. Lines are
        aggregated by Ray for the whole job, not per mesh: `aggregate_window_sec` must be
        None or a number >= 0 and changes nothing (`RAY_DEDUP_LOGS=0` turns aggregation off)."""
        from raymesh._src.logs import LoggingOption

        if aggregate_window_sec is not None and not aggregate_window_sec >= 0:
            raise ValueError(
                f"logging_option(aggregate_window_sec={aggregate_window_sec!r}): give None or "
                "a number of seconds >= 0"
            )
        if not isinstance(level, int) or isinstance(level, bool):
            raise TypeError(f"logging_option(level={level!r}): give a level such as logging.INFO")

        def apply() -> None:
            self.spawn("raymesh-logging", LoggingOption, bool(stream_to_client), level).stop()

        await asyncio.get_running_loop().run_in_executor(None, apply)

    def __repr__(self) -> str:
        return f"ProcMesh({self.name!r}, {self._shape})"
