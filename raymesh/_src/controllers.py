"""`get_or_spawn_controller(name, Cls, *args)`: one actor per name per job, shared by every
process of the job.

The first call for a name spawns `Cls(*args, **kwargs)` on a proc of its own; every call for
that name, from the controller script or from any actor of the job, gets a reference to that
same actor (a mesh of one, with no axes, so `call_one` reaches it). As in Monarch, where a
`_ControllerController` keeps them, for the singletons a job shares: a debugger, a replay
buffer, a weight store, a coordinator.

Guarantees:
- One per name per job: concurrent first calls, from any processes, spawn it once (the job's
  registry changes each name under its own lock; see `backend.registry`). Later calls ignore
  their `args`; asking for a name with a different class raises ValueError.
- Owned by the job, not by the caller: the job's registry spawns it, in the registry's own
  process (a Ray actor that the driver, or the driver's host agent, owns; see
  `backend.registry`), so it outlives the actor that first asked for it and ends with the job,
  like every proc of the job. Its proc runs on the registry's host (that of whoever first asked
  for any controller; the first host with room when that one has no CPUs), reserving a sliver
  of a CPU (`cpus_per_proc=0`): a controller mostly coordinates.
- Failures: a spawn that fails (no room, a constructor that raised) raises from the future,
  nothing is kept, and the next call tries again. Once spawned, a failure of the controller (its
  proc died, a `broadcast` to it raised) is kept by the registry: calls on it
  raise `SupervisionError`, and so does every later `get_or_spawn_controller` of that name
  (Monarch raises ValueError there); it is not respawned. The failure goes to no
  `__supervise__` and to no fault hook: the registry is its owner, and handles it so.
- A controller's constructor must not ask for itself (its name's lock is held while it runs):
  that spawn fails after the spawn timeout.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, TypeVar

from raymesh._src import backend
from raymesh._src.actor_mesh import ActorMesh
from raymesh._src.errors import MeshFailure, SupervisionError
from raymesh._src.future import Future
from raymesh._src.host_mesh import host_mesh
from raymesh._src.proc_mesh import ProcMesh

logger = logging.getLogger("raymesh")

T = TypeVar("T")

__all__ = ["get_or_spawn_controller"]


def get_or_spawn_controller(
    name: str, cls: type[T], *args: Any, **kwargs: Any
) -> Future[ActorMesh[T]]:
    """The job's controller `name`: spawned as `cls(*args, **kwargs)` on a proc of its own by
    the first call, the same actor for every later one (see the module docstring). Returns at
    once; the future gives the `ActorMesh` (a mesh of one, with no axes)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"get_or_spawn_controller(name={name!r}): give a non-empty name")
    if not isinstance(cls, type):
        raise TypeError(
            f"get_or_spawn_controller({name!r}, {cls!r}): pass the actor class, not an instance"
        )
    make = functools.partial(_get_or_spawn, name, cls, args, kwargs)
    pending = backend.registry_update(f"controller:{name}", make)
    return Future([pending], _reply, _registry_gone, f"get_or_spawn_controller({name!r})")


class _Controller:
    """What the registry keeps for one controller: the procs it owns, and the actor on them."""

    def __init__(self, procs: ProcMesh, mesh: ActorMesh) -> None:
        self.procs = procs
        self.mesh = mesh

    def failure(self) -> MeshFailure | None:
        """How the controller failed (its proc, or the actor itself); None while it has not."""
        state = self.mesh._state
        error = state.proc_state.check(self.mesh._shape.ranks, state.key)
        return error.failure if error is not None else None


def _get_or_spawn(
    name: str, cls: type, args: tuple, kwargs: dict, current: _Controller | None
) -> tuple[_Controller, ActorMesh]:
    """Runs in the registry's process, under the name's lock: (what to keep, the reply)."""
    if current is not None:
        failure = current.failure()
        if failure is not None:
            raise SupervisionError(failure)
        have = current.mesh._state.cls
        if _qualname(have) != _qualname(cls):
            raise ValueError(
                f"get_or_spawn_controller({name!r}, {cls.__name__}): controller {name!r} is "
                f"already a {_qualname(have)}; ask for it with that class, or use another name"
            )
        return current, current.mesh
    procs = _host_with_room().spawn_procs(
        per_host={"procs": 1}, name=name, cpus_per_proc=0, escalate=False
    )
    try:
        one = procs.slice(**dict.fromkeys(procs.sizes, 0))  # no axes, as Monarch's controllers
        mesh: ActorMesh = one.spawn(name, cls, *args, **kwargs)
        spawned = _Controller(procs, mesh)
        failure = spawned.failure()  # a constructor that raised, where spawn records it
        if failure is not None:
            raise SupervisionError(failure)
    except BaseException:
        try:
            procs.stop()
        except Exception:  # the spawn's own error is the one to report
            logger.warning("raymesh: stopping the procs of controller %r failed", name)
        raise
    return spawned, mesh


def _host_with_room() -> Any:
    """The registry's own host, unless it cannot hold a proc at all (a head node started with
    no CPUs): then the first host that can."""
    hosts = host_mesh()  # the caller's host first
    room = hosts.free_procs(cpus_per_proc=0)
    here = hosts.node_ids[0]
    pick = here if here in room or not room else next(iter(room))
    return hosts.select_hosts([pick])


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _reply(raws: list[Any]) -> Any:
    ok, value = raws[0]
    if not ok:
        raise value
    return value


def _registry_gone(index: int, detail: str) -> BaseException:
    return RuntimeError(
        f"the job's registry of controllers is gone ({detail}): it ends with the job (see "
        "raymesh._src.backend.registry)"
    )
