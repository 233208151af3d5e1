"""Where a training job's ranks run: nodes with room, ordered by the topology planner.

`Placer` answers two questions for the controller and the rank pool: which nodes have room for
`n` more ranks now (`pick_nodes`: this host first), and where the first `n` ranks of a job go
(`place`: with room on several hosts, the order in which every process group crosses the
fewest and fastest links). It asks the cluster what is free through the core's public API and
plans with raymesh.topology; it spawns nothing.
"""

from __future__ import annotations

import dataclasses
import logging

from raymesh import topology
from raymesh.actor import host_mesh
from raymesh.topology import Placement, used
from raymesh.train.sections import ParallelismConfig, ScalingConfig
from raymesh.train.strategy import host_shard_size, splits_into_shard_groups

logger = logging.getLogger("raymesh")

__all__ = ["Placer", "use_gpus"]


def use_gpus(scaling: ScalingConfig) -> bool:
    """Whether the job's ranks get a GPU each (`TrainConfig.scaling`): `gpus=True` demands one
    per min_workers rank, "auto" takes them when the cluster has that many, False never."""
    if scaling.gpus is False:
        return False
    have = host_mesh().gpus
    if scaling.gpus is True and have < scaling.min_workers:
        raise ValueError(f"gpus=True asks for {scaling.min_workers} GPUs; the cluster has {have:g}")
    return have >= scaling.min_workers


class Placer:
    """Nodes for a job's ranks (see the module docstring)."""

    def __init__(
        self,
        scaling: ScalingConfig,
        parallelism: ParallelismConfig,
        *,
        gpus: bool | None = None,
    ) -> None:
        self.scaling = scaling
        self.parallelism = parallelism
        self.gpus = use_gpus(scaling) if gpus is None else gpus  # one GPU per rank
        # The topology plans of the last `place`, by strategy, on the places the ranks hold
        # (several only where HSDP may be chosen), and why the ranks run where they do.
        self.plans: dict[str, Placement] = {}
        self.reason: str | None = None
        self.topology: topology.Topology | None = None  # what the last plan was made on
        self._unplanned: str | None = None  # why the last plan failed, as said

    def free(self) -> dict[str, int]:
        """How many more ranks fit on each node now, this host first."""
        return host_mesh().free_procs(cpus_per_proc=self.scaling.cpus_per_worker, gpu=self.gpus)

    def capacity(self) -> int:
        """How many ranks the cluster's hosts could hold with nothing else running."""
        return host_mesh().capacity(cpus_per_proc=self.scaling.cpus_per_worker, gpu=self.gpus)

    def pick_nodes(self, n: int, free: dict[str, int] | None = None) -> list[str]:
        """Up to `n` nodes (one per new rank, repeated) with room now (or in `free`, ranks
        that fit per node), this host first."""
        out: list[str] = []
        for node, fits in (self.free() if free is None else free).items():
            out.extend([node] * min(fits, n - len(out)))
        return out

    def place(self, n: int) -> list[str]:
        """Nodes for the first `n` ranks, in rank order. With room on several hosts, the
        topology planner orders them so that each process group crosses the fewest and fastest
        links, each host's ranks next to each other (one ring hop across hosts; HSDP's shard
        groups can be one host each). Where HSDP may be chosen, the strategies are planned on
        the same places too (`plans`), so the decision can weigh their communication; on one
        host there is nothing to choose."""
        cfg = self.parallelism
        self.plans = {}
        free = self.free()
        if len(free) < 2:  # one look at the room: a second could see more, without a plan
            return self.pick_nodes(n, free)
        if not self.gpus and not self._choice(n, free):
            return self.pick_nodes(n, free)
        topo = topology.discover(probe_timeout=5.0)
        if not self.gpus:  # CPU procs: plan over the room there is now
            hosts = tuple(
                dataclasses.replace(h, cpus=float(free.get(h.node_id, 0))) for h in topo.hosts
            )
            topo = dataclasses.replace(topo, hosts=hosts)
        device = "gpu" if self.gpus else "cpu"
        base = "fsdp" if cfg.strategy == "fsdp" else "ddp"
        try:
            placement = topology.plan(
                topo, topology.JobShape(world_size=n, strategy=base, device=device)
            )
        except ValueError as e:  # less room than ranks: take what there is (elastic may start)
            if str(e) != self._unplanned:  # once, not on every look while the room is awaited
                self._unplanned = str(e)
                logger.warning("raymesh.train: no placement plan (%s); packing instead", e)
            return self.pick_nodes(n, free)
        self.plans[base] = placement
        # One group of every rank costs the same in any order: keep each host's ranks together,
        # hosts in topology order (the naive order of the places the plan chose), which is
        # also where HSDP's shard groups are one host each.
        there = used(topo, placement)
        order = [h.node_id for h in there.hosts]
        nodes = sorted(placement.node_ids, key=order.index)
        if shard := self._shard(n, nodes):
            for strategy in ("ddp", "fsdp", "hsdp"):
                dims = {"replicate": n // shard, "shard": shard} if strategy == "hsdp" else {}
                shape = topology.JobShape(world_size=n, strategy=strategy, device=device, **dims)
                self.plans[strategy] = topology.plan(there, shape, method="naive")
        self.reason = placement.reason
        self.topology = topo
        logger.info("raymesh.train: placement: %s", placement.reason)
        return nodes

    def _choice(self, n: int, free: dict[str, int]) -> bool:
        """Whether a plan could change anything for CPU ranks: they take all the room there is
        (no places to choose, and their order is already each host's ranks together), and no
        HSDP shard groups are there to weigh. Without one, `place` skips the topology's probes
        (a probe actor per host and every link timed: 5 s of a multi-host start here)."""
        nodes = self.pick_nodes(n, free)
        return len(nodes) < sum(free.values()) or self._shard(n, nodes) is not None

    def _shard(self, n: int, nodes: list[str]) -> int | None:
        """HSDP's shard group size where HSDP may be chosen for `n` ranks on `nodes` (the
        strategy allows it and they split into whole shard groups), else None."""
        shard = self.parallelism.shard_size or host_shard_size(nodes)
        allowed = self.parallelism.strategy in ("auto", "hsdp")
        return shard if allowed and shard and splits_into_shard_groups(n, shard) else None

    def choose(self, strategy: str) -> None:
        """The job runs `strategy`: the placement planned for it (if any) is the one that
        stands, and its reason the placement's."""
        if strategy in self.plans:
            self.reason = self.plans[strategy].reason

    def comm_costs(self) -> dict[str, float]:
        """The planned communication seconds per step, by strategy (empty without a plan)."""
        return {k: p.cost for k, p in self.plans.items()}
