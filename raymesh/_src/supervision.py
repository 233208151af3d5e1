"""Supervision: how an owner learns that a mesh it spawned failed, and who handles it.

Each process that owns proc meshes (the controller, or an actor that spawned meshes) runs one
`Supervisor` thread. For every proc it owns, it keeps one long-poll `watch` call pending on that
proc. The call returns when the proc has events (a broadcast that raised; an actor there that
left a child's failure unhandled) and fails the moment the proc dies, since Ray fails every
pending call of a dead actor. So a death reaches the owner in milliseconds even when nobody is
calling the mesh, at the cost of one idle pending call per proc.

Who handles a failure: the owner of the actor mesh it happened in (the actor that spawned it,
as in Monarch), else the proc mesh's owner: that actor's `__supervise__` (run beside its
endpoints, see `proc`); True stops it there, anything else makes it the owner's own failure,
reported up to *its* owner. At the controller, the unhandled-fault hook runs. An actor mesh
spawned on procs this process does not own (a proc mesh it was handed) is spawned with this
process's route: its proc keeps that mesh's events for this process, whose supervisor keeps a
watch of its own on those procs (`watch_routed`). The mesh itself is marked failed
first (a dead proc cannot come back), so later calls raise `SupervisionError` without waiting.
A mesh spawned with `escalate=False` is marked failed the same way but handed to nobody: its
owner reads `ProcMesh.failure` instead (raymesh.train's controller, which heals its ranks).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import types
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from raymesh._src import backend
from raymesh._src.context import actor_label
from raymesh._src.errors import MeshFailure
from raymesh._src.mesh_state import ProcMeshState
from raymesh._src.proc import current_runtime

logger = logging.getLogger("raymesh")

__all__ = ["FrontModule", "set_unhandled_fault_hook"]

# How long one watch call stays pending before it is re-armed (bounds an idle proc's cost).
WATCH_S = 30.0
# This process's route: procs keep the events of actor meshes it spawned on procs it does not
# own for it (see the module docstring).
ROUTE = uuid.uuid4().hex[:16]
# The actor meshes spawned in this process, by key (while a handle to one is alive): who owns
# each, and the proc mesh view its calls check.
_meshes: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


def register(mesh_state: Any) -> None:
    """An actor mesh was spawned here: its failures go to its owner (`owner_key`, `proc_state`,
    `shape` and `key` are read)."""
    _meshes[mesh_state.key] = mesh_state


def default_unhandled_fault_hook(failure: MeshFailure) -> None:
    """Log the failure; the mesh keeps it, so later calls on it raise SupervisionError."""
    logger.error("raymesh: unhandled mesh failure: %s", failure)


_hook: Callable[[MeshFailure], Any] = default_unhandled_fault_hook


def set_unhandled_fault_hook(fn: Callable[[MeshFailure], Any] | None) -> None:
    """Replace the controller's fault hook; None restores the default (log, keep the error).
    Assigning `raymesh.actor.unhandled_fault_hook = fn` does the same (see `FrontModule`)."""
    global _hook
    _hook = fn if fn is not None else default_unhandled_fault_hook


class FrontModule(types.ModuleType):
    """The class of the public modules (`raymesh`, `raymesh.actor`): their
    `unhandled_fault_hook` attribute *is* the controller's hook, read and assigned, because
    Monarch's programs replace the hook by assigning the module attribute
    (`monarch.actor.unhandled_fault_hook = fn`) and put back the one they read."""

    @property
    def unhandled_fault_hook(self) -> Callable[[MeshFailure], Any]:
        return _hook

    @unhandled_fault_hook.setter
    def unhandled_fault_hook(self, fn: Callable[[MeshFailure], Any] | None) -> None:
        set_unhandled_fault_hook(fn)

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), "unhandled_fault_hook"})

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        # By reference, as pickle does a plain module: an actor class defined in a user's
        # __main__ is pickled by value with its methods' globals, which hold `raymesh` itself
        # when the script does `import raymesh` (cloudpickle only knows `types.ModuleType`).
        return importlib.import_module, (self.__name__,)


def dispatch(state: ProcMeshState, actor_key: str | None, failure: MeshFailure) -> None:
    """Record `failure` on its mesh and hand it to the owner of its actor mesh, else of its
    proc mesh (in a thread of its own, so that one slow `__supervise__` never delays the
    next failure)."""
    owner_key = state.owner_key
    mesh = _meshes.get(actor_key) if actor_key is not None else None
    if mesh is not None:
        state, owner_key = mesh.proc_state, mesh.owner_key
    if not state.record(actor_key, failure):
        return  # the mesh was stopped, or this failure is already known

    if state.handled_by_owner:  # spawn_procs(escalate=False): the owner polls the mesh itself
        return

    def deliver() -> None:
        runtime = current_runtime()
        if owner_key is not None and runtime is not None:
            runtime.supervise(owner_key, failure)
        else:
            try:
                _hook(failure)
            except Exception:
                logger.exception("raymesh: unhandled_fault_hook raised")

    threading.Thread(target=deliver, name="raymesh-supervise", daemon=True).start()


class Supervisor:
    """This process's watcher of the procs it owns (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # pending watch -> (the mesh, the rank, whether it is a routed watch)
        self._watches: dict[Any, tuple[ProcMeshState, int, bool]] = {}
        self._routed: set[tuple[str, int]] = set()  # (proc mesh, rank) watched for ROUTE
        self._changed = threading.Event()
        self._in_ray = threading.Lock()  # held while this watcher calls into Ray (see quiesce)
        self._thread = threading.Thread(target=self._loop, name="raymesh-supervisor", daemon=True)
        self._thread.start()
        backend.before_shutdown(self.quiesce)

    def watch(self, state: ProcMeshState) -> None:
        with self._lock:
            for rank, proc in enumerate(state.procs):
                self._watches[proc.watch(WATCH_S)] = (state, rank, False)
        self._changed.set()

    def watch_routed(self, state: ProcMeshState, ranks: list[int]) -> None:
        """Watch procs `ranks` of a proc mesh this process does not own, for the events of
        the actor meshes it spawned there (once per proc)."""
        with self._lock:
            for rank in ranks:
                if (state.name, rank) not in self._routed:
                    self._routed.add((state.name, rank))
                    self._watches[state.procs[rank].watch(WATCH_S, ROUTE)] = (state, rank, True)
        self._changed.set()

    def forget(self, state: ProcMeshState) -> None:
        with self._lock:
            for ref in [r for r, (s, _, _) in self._watches.items() if s is state]:
                del self._watches[ref]

    def quiesce(self) -> None:
        """Forget every watch once the Ray call in flight (if any) has returned: Ray is about
        to shut down, and a thread inside a Ray call then can crash the process."""
        with self._in_ray, self._lock:
            self._watches.clear()
            self._routed.clear()

    def _loop(self) -> None:
        while True:
            with self._in_ray:
                with self._lock:
                    refs = list(self._watches)
                arrived = self._arrivals(refs) if refs else []
            if not refs:
                self._changed.wait(timeout=1.0)
                self._changed.clear()
                continue
            if arrived is None:  # Ray is shutting down
                self._changed.wait(timeout=1.0)
                continue
            for state, rank, routed, events in arrived:
                if routed:
                    self._handle_routed(state, rank, events)
                else:
                    self._handle(state, rank, events)

    def _arrivals(self, refs: list[Any]) -> list[tuple[ProcMeshState, int, bool, Any]] | None:
        """The watches that fired within a short wait, each with its events (or the ProcGone
        that ended it); None if Ray failed. Called holding `_in_ray`."""
        try:
            ready, _ = backend.wait(refs, 1, 0.2)
        except (Exception, SystemExit):  # its wait may SystemExit while Ray shuts down
            return None
        out = []
        for ref in ready:
            with self._lock:
                entry = self._watches.pop(ref, None)
            if entry is None:
                continue
            try:
                events: Any = backend.get([ref], timeout=5.0)[0]
            except backend.ProcGone as gone:
                events = gone
            except backend.RuntimeLostError:  # the program's waits raise it: nothing to watch
                return None
            except Exception:
                logger.exception("raymesh: watch on %s rank %d failed", entry[0].name, entry[1])
                continue
            out.append((*entry, events))
        return out

    def _handle(self, state: ProcMeshState, rank: int, events: Any) -> None:
        if isinstance(events, backend.ProcGone):
            dispatch(state, None, state.proc_gone(rank, events.detail))
            return
        if state.stopped or events is None:  # None: the proc is closing (it was stopped)
            return
        with self._in_ray, self._lock:  # watch() sends the proc a call
            self._watches[state.procs[rank].watch(WATCH_S)] = (state, rank, False)
        for actor_key, failure in events:
            dispatch(state, actor_key, failure)

    def _handle_routed(self, state: ProcMeshState, rank: int, events: Any) -> None:
        """Events a proc kept for this process: each goes to its actor mesh's owner. A dead
        proc fails each actor mesh this process spawned on it."""
        here = [
            m
            for m in list(_meshes.values())
            if m.proc_state.name == state.name and rank in m.shape.ranks and not m.proc_state.owned
        ]
        if isinstance(events, backend.ProcGone):
            with self._lock:
                self._routed.discard((state.name, rank))
            if here:
                failure = state.proc_gone(rank, events.detail)
                for mesh in here:  # the failure of that actor mesh, as its owner knows it
                    [point] = [p for p, r in mesh.shape.points() if r == rank]
                    label = actor_label(
                        f"{mesh.cls.__module__}.{mesh.cls.__qualname__}", mesh.name, point
                    )
                    mine = dataclasses.replace(
                        failure, mesh_name=mesh.name, ranks=(point.rank,), actor=label
                    )
                    dispatch(mesh.proc_state, mesh.key, mine)
            return
        with self._in_ray, self._lock:
            if here and events is not None:  # while an actor mesh of this process runs there
                self._watches[state.procs[rank].watch(WATCH_S, ROUTE)] = (state, rank, True)
            else:
                self._routed.discard((state.name, rank))
        for actor_key, failure in events or ():
            dispatch(state, actor_key, failure)


_supervisor: Supervisor | None = None
_supervisor_lock = threading.Lock()


def supervisor() -> Supervisor:
    global _supervisor
    with _supervisor_lock:
        if _supervisor is None:
            _supervisor = Supervisor()
        return _supervisor
