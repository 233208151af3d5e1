"""What every view (slice) of one proc mesh shares: its procs, its owner, and its failures.

A module of its own so that both `proc_mesh` (which creates and stops meshes) and `supervision`
(which records their failures) import it at the top, neither importing the other to name it.

Guarantees:
- a failure, once recorded, stays: a dead proc never comes back, so `check` fails every later
  call that includes its rank, at once and without sending anything;
- each proc death is reported to supervision once, however many pending calls and watchers
  saw it (`record` returns False for a death already reported);
- a copy sent to another process is a reference (`owned=False`): it can call and spawn, but
  not stop the mesh, and nobody watches it there.
"""

from __future__ import annotations

import threading
from typing import Any

from raymesh._src import backend
from raymesh._src.context import actor_label
from raymesh._src.errors import MeshFailure, SupervisionError

__all__ = ["ProcMeshState"]


class ProcMeshState:
    """What all views (slices) of one proc mesh share: its procs, owner and failures.

    handled_by_owner: the owner watches these procs itself (`spawn_procs(escalate=False)`):
        failures are recorded here, but `supervision.dispatch` hands them to nobody.
    """

    def __init__(
        self,
        name: str,
        procs: list[Any],
        group: Any,
        owner_key: str | None,
        owned: bool = True,
        *,
        handled_by_owner: bool = False,
    ) -> None:
        self.name = name
        self.procs = procs
        self.group = group  # backend.ProcGroup, or None for this_proc()
        self.owner_key = owner_key  # the owning actor in this process; None: the controller
        self.owned = owned
        self.stopped = False
        self.lock = threading.Lock()
        self.dead: dict[int, MeshFailure] = {}  # proc rank -> how it died
        self.killed: set[int] = set()  # ranks the owner SIGKILLed (`ProcMesh.kill()`)
        self.reported: set[int] = set()  # dead ranks already handed to supervision
        # The owner handles failures itself (e.g. the training controller heals them): record
        # them on the mesh, but do not escalate them to the unhandled fault hook. Set when the
        # mesh is created, before anything watches it, so no failure can slip past it.
        self.handled_by_owner = handled_by_owner
        self.actor_failures: dict[str, MeshFailure] = {}  # actor key -> unhandled failure
        # actor key -> (module.Class, mesh name, shape): who runs here, to name a dead proc's
        self.actors: dict[str, tuple[str, str, Any]] = {}

    def record(self, actor_key: str | None, failure: MeshFailure) -> bool:
        """Keep `failure` for later calls; False when the mesh is stopped or the failure was
        already recorded (a death is seen both by pending calls and by the watcher)."""
        with self.lock:
            if self.stopped:
                return False
            if actor_key is not None:
                self.actor_failures.setdefault(actor_key, failure)
                return True
            if failure.kind == "proc_died":
                fresh = [r for r in failure.ranks if r not in self.reported]
                self.reported.update(failure.ranks)
                for r in failure.ranks:
                    self.dead.setdefault(r, failure)
                return bool(fresh)
            return True

    def proc_gone(self, rank: int, detail: str) -> MeshFailure:
        """The failure for proc `rank`, which Ray reported dead: asks its host how it ended."""
        with self.lock:
            known = self.dead.get(rank)
        if known is not None:
            return known
        if self.stopped:
            return MeshFailure(self.name, (rank,), "stopped", "the mesh was stopped")
        status = self.procs[rank].exit_status(timeout=2.0) or {}
        cause = status.get("cause") or detail
        failure = MeshFailure(
            mesh_name=self.name,
            ranks=(rank,),
            kind="proc_died",
            cause=f"proc (pid {self.procs[rank].pid}) {cause}",
            exit_code=status.get("exit_code"),
            signal=status.get("signal"),
            actor=self._actor_on(rank),
        )
        with self.lock:
            return self.dead.setdefault(rank, failure)

    def _actor_on(self, rank: int) -> str | None:
        """The newest actor that runs on proc `rank`, named as Monarch names it."""
        with self.lock:
            actors = list(self.actors.values())
        for class_name, name, shape in reversed(actors):
            for point, r in shape.points():
                if r == rank:
                    return actor_label(class_name, name, point)
        return None

    def check(self, ranks: tuple[int, ...], actor_key: str | None) -> SupervisionError | None:
        """The error a new call on `ranks` must fail with, if any."""
        if self.stopped:
            return SupervisionError(
                MeshFailure(
                    self.name,
                    ranks,
                    "stopped",
                    "the mesh was stopped; spawn a new one with spawn_procs()",
                )
            )
        dead = [self.dead[r] for r in ranks if r in self.dead]
        if dead:  # calls to slices that avoid the dead procs still go through
            return SupervisionError(dead[0])
        if actor_key is not None and actor_key in self.actor_failures:
            return SupervisionError(self.actor_failures[actor_key])
        return None

    def __reduce__(self):  # a copy in another process is a reference, not an owner
        # The cluster's address first: a process without Ray joins it before the procs'
        # handles are read (pickle reads arguments in order).
        return (_rebuild_state, (_Cluster(backend.address()), self.name, self.procs, self.group))


class _Cluster:
    """Unpickles as a connection to the cluster at `address` (see `ProcMeshState.__reduce__`)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def __reduce__(self):
        return (backend.join, (self.address,))


def _rebuild_state(_: None, name: str, procs: list[Any], group: Any) -> ProcMeshState:
    return ProcMeshState(name, procs, group, owner_key=None, owned=False)
