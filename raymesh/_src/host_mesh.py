"""Host meshes: the hosts (Ray nodes) procs run on, and how procs are asked of them.

- `host_mesh()`: every alive Ray node that can run a proc, along the axis `hosts`;
  `this_host()`: the caller's node; `hosts_from_config(name)`: the hosts an environment
  variable names.
- `HostMesh.spawn_procs(per_host={"gpus": 8})`: one proc (process) per point of
  `hosts x per_host`, gang-scheduled with one Ray placement group: all procs start, or none do.
  An axis named `gpus` gives each proc one GPU; any other name gives CPU procs.
  `spawn_procs(placement=topology.plan(...))`: one proc per rank of a plan, each on its planned
  host, along the plan's group axes (`replicate`, `shard`, `tp`).

A host mesh decides which procs to ask for, and where; raymesh._src.proc_mesh creates them
and owns them.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Protocol

from raymesh._src import backend
from raymesh._src.proc_mesh import ProcMesh, create_proc_mesh, proc_resources
from raymesh._src.shape import Extent, MeshTrait, Shape

logger = logging.getLogger("raymesh")

__all__ = [
    "HostMesh",
    "PlacedRank",
    "PlanLayout",
    "RankPlacement",
    "host_mesh",
    "hosts_from_config",
    "this_host",
]

_GPU_AXIS = "gpus"
_said_cpu_gpus = threading.Event()


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

    def capacity(self, *, cpus_per_proc: float = 1.0, gpu: bool = False) -> int:
        """How many procs of `cpus_per_proc` CPUs (one GPU each, with `gpu`) these hosts could
        hold with nothing else running: what `free_procs` can grow to, at most."""
        fits = 0
        for r in self._shape.ranks:
            node = self._nodes[r]
            cpus = int(node.cpus / cpus_per_proc + 1e-9) if cpus_per_proc > 0 else 1 << 30
            fits += min(cpus, int(node.gpus)) if gpu else cpus
        return fits

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
        free = backend.free_slots(proc_resources(cpus_per_proc, gpu))
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
        return create_proc_mesh(
            extent, node_ids, name, cpus_per_proc, gpu, timeout, asked, escalate
        )

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
        return create_proc_mesh(
            extent, placement.node_ids, name, cpus_per_proc, gpu, timeout, asked, escalate
        )

    def __repr__(self) -> str:
        return f"HostMesh({self._shape})"


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
