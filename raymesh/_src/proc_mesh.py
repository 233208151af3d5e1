"""Host meshes and proc meshes: where actors run.

- `host_mesh()`: every alive Ray node, along the axis `hosts`; `this_host()`: the caller's node.
- `HostMesh.spawn_procs(per_host={"gpus": 8})`: one proc (process) per point of
  `hosts x per_host`, gang-scheduled with one Ray placement group: all procs start, or none do.
  An axis named `gpus` gives each proc one GPU; any other name gives CPU procs.
  `spawn_procs(placement=topology.plan(...))`: one proc per rank of a plan, each on its planned
  host, along the plan's group axes (`replicate`, `shard`, `tp`).
- `ProcMesh.spawn(name, Actor, ...)`: one actor per proc, constructed before `spawn` returns.
- `this_proc()`: the caller's own process as a mesh of one (the controller's, or an actor's).

A proc mesh belongs to the process that spawned it: that process's supervisor watches it, and it
ends with that process (Ray ends non-detached actors with their owner). Copies sent to other
actors are references: they can spawn and call, but do not own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeVar

from raymesh._src import backend, ownership
from raymesh._src.context import current_actor_context, current_rank
from raymesh._src.errors import MeshFailure
from raymesh._src.future import Future
from raymesh._src.mesh_state import ProcMeshState
from raymesh._src.proc import ProcRuntime, start_proc_runtime
from raymesh._src.shape import Extent, MeshTrait, Point, Shape

logger = logging.getLogger("raymesh")

T = TypeVar("T")

__all__ = [
    "HostMesh",
    "ProcMesh",
    "host_mesh",
    "hosts_from_config",
    "shutdown_context",
    "this_host",
    "this_proc",
]

_GPU_AXIS = "gpus"
_said_cpu_gpus = threading.Event()
_STOP_TIMEOUT_S = 30.0


# What `spawn_procs(placement=...)` reads from a plan, as protocols: the core names no type of
# `raymesh.topology` (a layer above it), and `raymesh.topology.Placement` fits them as it is
# (mypy checks that in raymesh/topology/planner.py).
class PlacedRank(Protocol):
    """Where one rank of a plan runs."""

    @property
    def node_id(self) -> str: ...  # Ray node id of its host

    @property
    def host(self) -> str: ...  # the host's name, for error messages

    @property
    def device(self) -> int | None: ...  # device index on that host; None for a CPU proc


class PlanLayout(Protocol):
    """A plan's rank layout: (replicate, shard, tp) degrees, rank = (r * shard + s) * tp + t."""

    @property
    def dims(self) -> tuple[int, int, int]: ...

    def describe(self) -> str: ...


class RankPlacement(Protocol):
    """A plan of where each rank runs, as `raymesh.topology.plan(...)` returns it."""

    @property
    def shape(self) -> PlanLayout: ...

    @property
    def assignments(self) -> Sequence[PlacedRank]: ...  # assignments[r]: where rank r runs

    @property
    def node_ids(self) -> list[str]: ...  # each rank's node id, in rank order


class HostMesh(MeshTrait):
    """Hosts (Ray nodes) along the axis `hosts`."""

    def __init__(self, nodes: list[backend.NodeInfo], shape: Shape | None = None) -> None:
        self._nodes = nodes
        self._shape = shape or Shape.of({"hosts": len(nodes)})

    def _new_with_shape(self, shape: Shape) -> HostMesh:
        return HostMesh(self._nodes, shape)

    @property
    def node_ids(self) -> list[str]:
        return [self._nodes[r].node_id for r in self._shape.ranks]

    @property
    def addresses(self) -> list[str]:
        """Each host's address, as the cluster's processes reach it (a process group's store
        on that host listens there)."""
        return [self._nodes[r].ip for r in self._shape.ranks]

    @property
    def hostnames(self) -> list[str]:
        """Each host's name, for people (tools, logs, the dashboard)."""
        return [self._nodes[r].hostname for r in self._shape.ranks]

    @property
    def gpus(self) -> float:
        """The GPUs of these hosts, in all (free or not)."""
        return sum(self._nodes[r].gpus for r in self._shape.ranks)

    def select_hosts(self, node_ids: Sequence[str]) -> HostMesh:
        """A mesh of the hosts with these node ids, in that order. Raises ValueError naming
        any that are not in this mesh (a host that left the cluster)."""
        mine = {self._nodes[r].node_id: self._nodes[r] for r in self._shape.ranks}
        missing = [n for n in node_ids if n not in mine]
        if missing:
            raise ValueError(
                f"select_hosts: {[n[:12] for n in missing]} not among this mesh's "
                f"{len(mine)} host(s); take node ids from host_mesh().node_ids"
            )
        return HostMesh([mine[n] for n in node_ids])

    def free_procs(self, *, cpus_per_proc: float = 1.0, gpu: bool = False) -> dict[str, int]:
        """How many more procs of `cpus_per_proc` CPUs (and one GPU each, with `gpu`) each
        host of this mesh could hold now, by node id: hosts with room only, the caller's host
        first. A snapshot: another spawn may take the room first (spawn_procs then waits for
        room, up to its timeout)."""
        mine = set(self.node_ids)
        free = backend.free_slots(_resources(cpus_per_proc, gpu))
        return {node: n for node, n in free.items() if node in mine}

    def spawn_procs(
        self,
        per_host: Mapping[str, int] | None = None,
        *,
        placement: RankPlacement | None = None,
        name: str | None = None,
        cpus_per_proc: float = 1.0,
        timeout: float = 60.0,
        escalate: bool = True,
    ) -> ProcMesh:
        """One proc per point of this host mesh's axes plus `per_host`; or, with `placement`
        (a `raymesh.topology.plan`), one proc per rank of the plan, rank r on its planned
        host, along the plan's group axes: `replicate`, `shard` and `tp` where they have more
        than one rank (DDP: `replicate`; FSDP: `shard`; HSDP: both), so that
        `procs.slice(replicate=0)` is a shard group. A GPU plan gives each proc one GPU (Ray
        picks which GPU of the host).

        cpus_per_proc: logical CPUs each proc reserves (the embedded local Ray has many logical
            CPUs; see `raymesh._src.backend.runtime`). timeout: seconds to wait for resources.
        escalate=False: the owner watches these procs itself (raymesh.train's controller heals
            them): a failure is still recorded on the mesh (later calls raise
            SupervisionError, and `ProcMesh.failure` says what it was) but is not handed to the
            owner's `__supervise__` or to the unhandled-fault hook. Set before the procs are
            watched, so no failure is escalated in between.
        Raises ValueError for a bad `per_host` or a plan for hosts outside this mesh,
        PlacementError when the cluster cannot hold it.
        """
        if not cpus_per_proc >= 0:
            raise ValueError(f"cpus_per_proc={cpus_per_proc!r} must be >= 0")
        if placement is not None:
            return self._spawn_placed(placement, name, cpus_per_proc, timeout, escalate)
        per_host = dict(per_host or {"procs": 1})
        asked = f"spawn_procs(per_host={per_host})"
        for axis, n in per_host.items():
            if axis in self._shape.labels:
                raise ValueError(f"{asked}: axis {axis!r} is already a host axis; rename it")
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{asked}: {axis}={n!r}; each per_host size must be an int >= 1")
        extent = Extent(
            self._shape.labels + tuple(per_host),
            self._shape.extent.sizes + tuple(per_host.values()),
        )
        per = Extent.of(per_host).nelem
        node_ids = [n for n in self.node_ids for _ in range(per)]
        # An axis named `gpus` gives each proc a GPU of its host. On hosts with no GPU at all it
        # is only a name, as in Monarch, whose CPU examples say `gpus`: CPU procs, said once.
        gpu = _GPU_AXIS in per_host and self.gpus > 0
        if _GPU_AXIS in per_host and not gpu and not _said_cpu_gpus.is_set():
            _said_cpu_gpus.set()
            logger.warning(
                "raymesh: axis 'gpus' on hosts without GPUs: CPU procs (on hosts with GPUs each "
                "proc of a 'gpus' axis gets one)"
            )
        return _create(extent, node_ids, name, cpus_per_proc, gpu, timeout, asked, escalate)

    def _spawn_placed(
        self,
        placement: RankPlacement,
        name: str | None,
        cpus_per_proc: float,
        timeout: float,
        escalate: bool,
    ) -> ProcMesh:
        asked = f"spawn_procs(placement=<{placement.shape.describe()}>)"
        mine = set(self.node_ids)
        outside = sorted({a.host for a in placement.assignments if a.node_id not in mine})
        if outside:
            raise ValueError(
                f"{asked}: the plan places ranks on host(s) {outside}, which are not in this "
                f"host mesh ({len(mine)} host(s)). Fix: plan on this mesh's hosts, or spawn "
                "from host_mesh()"
            )
        dims = dict(zip(("replicate", "shard", "tp"), placement.shape.dims))
        axes = {k: v for k, v in dims.items() if v > 1} or {"replicate": 1}
        gpu = any(a.device is not None for a in placement.assignments)
        # Points in row-major order are ranks in the plan's layout ((r * shard + s) * tp + t).
        extent = Extent.of(axes)
        return _create(
            extent, placement.node_ids, name, cpus_per_proc, gpu, timeout, asked, escalate
        )

    def __repr__(self) -> str:
        return f"HostMesh({self._shape})"


def _resources(cpus_per_proc: float, gpu: bool) -> dict[str, float]:
    """What one proc reserves (a proc with no CPU still holds a sliver, so Ray places it)."""
    res = {"CPU": float(cpus_per_proc), "GPU": 1.0 if gpu else 0.0}
    return {k: v for k, v in res.items() if v > 0} or {"CPU": 0.001}


def _create(
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
    resources = _resources(cpus_per_proc, gpu)
    mesh_name = name or f"procs{uuid.uuid4().hex[:6]}"
    points = list(extent.points())
    group = backend.create_procs(
        mesh_name, points, node_ids, resources, timeout, asked, start_runtime=start_proc_runtime
    )
    state = ProcMeshState(
        mesh_name, group.procs, group, _owner_key(), handled_by_owner=not escalate
    )
    _own(state)
    return ProcMesh(state, Shape.of(dict(extent)))


def host_mesh(*, all_hosts: bool = False) -> HostMesh:
    """The alive Ray nodes that can run a proc (with CPUs or GPUs), the controller's own first.

    A node with neither, such as the head node of Ray's recommended cluster setup (started
    with `num_cpus=0` to keep work off it), is left out, so that
    `host_mesh().spawn_procs(per_host=...)` puts procs on every host that can hold them.
    all_hosts=True includes such nodes too (to list or address every node; spawning procs
    on one raises PlacementError naming it). On a cluster where no node has CPUs or GPUs,
    every node is returned, and spawning says why it cannot."""
    nodes = backend.nodes()
    if all_hosts:
        return HostMesh(nodes)
    return HostMesh([n for n in nodes if n.cpus > 0 or n.gpus > 0] or nodes)


def preload(*modules: str) -> None:
    """Have warm procs import `modules` while they wait, so that a proc adopted from the pool
    already has them (see docs/programming-model.md, "Warm procs"). For imports that cost
    seconds and that most procs of the program make: a model library, a tokenizer. Applies to
    warm procs started from now on; a module that fails to import there is skipped (it fails
    again, visibly, where the proc imports it)."""
    for m in modules:
        if not isinstance(m, str) or not all(part.isidentifier() for part in m.split(".")):
            raise ValueError(
                f"preload({m!r}): give dotted module names as strings, e.g. "
                "preload('transformers', 'my_project.model')"
            )
    backend.preload(modules)


def hosts_from_config(name: str) -> HostMesh:
    """Monarch's: the job's hosts, as configured under `name`. In raymesh the environment
    variable `name` says which of the Ray cluster's hosts: unset, all of them (`host_mesh()`);
    a number N, the first N; a comma-separated list, the hosts with those addresses."""
    hosts = host_mesh()
    wanted = os.environ.get(name, "").strip()
    if not wanted:
        return hosts
    if wanted.isdigit():
        n = int(wanted)
        if not 1 <= n <= len(hosts.node_ids):
            raise ValueError(
                f"{name}={wanted}: the cluster has {len(hosts.node_ids)} host(s); ask for 1 to "
                f"{len(hosts.node_ids)}, or unset {name} for all of them"
            )
        return hosts.select_hosts(hosts.node_ids[:n])
    by_address = dict(zip(hosts.addresses, hosts.node_ids))
    addresses = [a.strip() for a in wanted.split(",") if a.strip()]
    unknown = [a for a in addresses if a not in by_address]
    if unknown:
        raise ValueError(
            f"{name}={wanted!r}: no host at {unknown}; the cluster's hosts are {sorted(by_address)}"
        )
    return hosts.select_hosts([by_address[a] for a in addresses])


def this_host() -> HostMesh:
    """The caller's own node, as a host mesh of one with no axes (as in Monarch): its procs
    have only the `per_host` axes (`host_mesh()` has the `hosts` axis)."""
    here = backend.current_node_id()
    return HostMesh([n for n in backend.nodes() if n.node_id == here], Shape.of({}))


def _owner_key() -> str | None:
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
    actors' `__cleanup__` runs, each proc ends and is waited for), then in the controller
    disconnects from Ray if raymesh connected (the local Ray raymesh started stops with it; a
    `ray.init` of the user's own is left as it is). Idempotent; a later spawn connects again.
    Returns a resolved Future (it has waited)."""
    from raymesh._src.proc import current_runtime

    for state in list(_owned):
        try:
            _stop(state, wait=True)
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


def _stop(state: ProcMeshState, *, wait: bool, timeout: float = _STOP_TIMEOUT_S) -> None:
    with state.lock:
        if state.stopped:
            return
        state.stopped = True
    from raymesh._src.supervision import supervisor

    supervisor().forget(state)
    ownership.disown(state.owner_key, state)
    if state.group is None:
        return
    if wait:  # the actors stop first: their __cleanup__ runs, the meshes they own stop
        _stop_actors(state, timeout)
    backend.kill(state.group)
    if wait:
        alive = backend.wait_exited(state.group.procs, timeout)
        if alive:
            raise TimeoutError(f"procs {alive} of mesh {state.name!r} still run after {timeout}s")


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
        `await procs.stop()` works too). Later calls on its actors raise SupervisionError."""
        if not self._state.owned:
            raise RuntimeError(f"only the owner of mesh {self.name!r} can stop it")
        _stop(self._state, wait=True, timeout=timeout)
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


class LocalProc:
    """The controller's own process as a proc, for `this_proc()` in the controller.

    Messages go through the same `ProcRuntime` as on a real proc (same ordering, same errors),
    on a local thread pool; arguments are pickled and unpickled, as they would be on the wire.
    """

    pid = -1
    node_id = ""

    def __init__(self) -> None:
        self._state: ProcMeshState | None = None
        self.runtime = ProcRuntime(
            proc_mesh_name="controller", point=current_rank(), on_event=self._on_event
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="raymesh-local")

    def _on_event(self, actor_key: str | None, failure: MeshFailure) -> None:
        from raymesh._src.supervision import dispatch

        if self._state is not None:
            dispatch(self._state, actor_key, failure)

    def submit(
        self,
        actor_key: str,
        sender: str,
        seq: int,
        endpoint: str,
        payload: Any,
        message_point: tuple,
        reply: bool,
    ) -> concurrent.futures.Future:
        args, kwargs = _copy(payload)
        return self._pool.submit(
            self.runtime.handle,
            actor_key,
            sender,
            seq,
            endpoint,
            args,
            kwargs,
            message_point,
            reply,
        )

    def spawn(self, actor_key: str, mesh_name: str, point: Point, cls: type, payload: Any) -> Any:
        args, kwargs = _copy(payload)
        return self._pool.submit(self.runtime.spawn, actor_key, mesh_name, point, cls, args, kwargs)

    def stop_actor(self, actor_key: str) -> None:
        self.runtime.stop_actor(actor_key)

    def exit_status(self, timeout: float) -> None:
        return None

    def __reduce__(self):
        raise TypeError(
            "an actor spawned with this_proc() in the controller lives in the controller's "
            "process and cannot be sent to other actors; spawn it on procs from spawn_procs() "
            "to share it"
        )


def _copy(payload: Any) -> Any:
    if type(payload) is list:  # stored once for a fan-out call
        payload = backend.get(payload, None)[0]
    return backend.roundtrip(payload)


_local_proc: LocalProc | None = None


def this_proc() -> ProcMesh:
    """The caller's own process as a mesh of one: actors spawned on it run in this process."""
    global _local_proc
    proc = backend.self_proc()
    if proc is not None:
        state = ProcMeshState(f"proc-{proc.pid}", [proc], None, _owner_key(), owned=False)
        return ProcMesh(state, Shape.of({}))
    if _local_proc is None:
        _local_proc = LocalProc()
        state = ProcMeshState("controller", [_local_proc], None, None, owned=False)
        _local_proc._state = state
    assert _local_proc._state is not None
    return ProcMesh(_local_proc._state, Shape.of({}))
