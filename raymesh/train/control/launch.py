"""How a training job's first world starts: its ranks placed and spawned, then its strategy
decided from what they measured. The controller's Starting state calls the two in turn,
handing each only the section it reads.

- `first_ranks` (`ScalingConfig`): up to `max_workers` ranks, warm procs a previous job left up
  first, the rest placed by the `Placer`; a cluster that frees resources a moment late is asked
  again for up to 10 s (never past `replace_timeout_s`), while what it can hold at all is more
  than what is free. With room for fewer than max but at least `min_workers`, an elastic job
  starts with what fits (the recruiter grows it later).
- `strategy_for` (`ParallelismConfig`, and the step's precision): the `StrategyPolicy`'s
  decision for the world, from the ranks' memory estimate and the smallest budget among them.
  An elastic start below max whose world splits into no whole shard groups decides "auto"
  without HSDP, and a requested HSDP as at max (the World runs it resized, FSDP over every
  rank, until it grows back). Offload on CPU ranks and fp16 with a sharded strategy are
  ValueErrors naming the field and the fix.
"""

from __future__ import annotations

import logging
import time

from raymesh.train.config import check_fp16
from raymesh.train.control.member import Rank
from raymesh.train.control.placement import Placer
from raymesh.train.control.ranks import RankPool
from raymesh.train.protocol import SetupInfo
from raymesh.train.sections import ParallelismConfig, ScalingConfig
from raymesh.train.strategy import (
    StrategyDecision,
    StrategyPolicy,
    host_shard_size,
    splits_into_shard_groups,
)

__all__ = ["first_ranks", "strategy_for"]

logger = logging.getLogger("raymesh")


def first_ranks(scaling: ScalingConfig, pool: RankPool, placer: Placer) -> list[Rank]:
    """The first world's ranks, spawned (see the module docstring)."""
    most = scaling.max_workers
    reused = pool.take_warm(most)  # procs a previous job left up
    need = most - len(reused)
    nodes = placer.place(need) if need else []
    # Resources a previous job just released can take the cluster a moment to report free:
    # ask again, but only while the room can still grow (an elastic job on a cluster too small
    # for max_workers starts with what fits at once).
    deadline = time.monotonic() + min(scaling.replace_timeout_s, 10.0)
    can_hold = min(need, placer.capacity() - len(reused)) if need else 0
    while len(nodes) < can_hold and time.monotonic() < deadline:
        time.sleep(0.5)
        nodes = placer.place(need)
    world, room = most, len(reused) + len(nodes)
    if scaling.min_workers <= room < world:
        world = room  # elastic: start with what fits; the recruiter grows it later
        logger.warning(
            "raymesh.train: room for %d of max %d workers now: starting with %d",
            world,
            most,
            world,
        )
    new = world - len(reused)
    return reused + pool.spawn(new, "trainer", nodes=nodes[:new])


def strategy_for(
    parallelism: ParallelismConfig,
    precision: str,
    infos: list[SetupInfo],
    ranks: list[Rank],
    *,
    max_workers: int,
    placer: Placer,
    policy: StrategyPolicy,
) -> StrategyDecision:
    """The strategy of the world `ranks` form, each having measured `infos` (see the module
    docstring)."""
    estimate = infos[0].estimate
    assert estimate is not None
    world, requested = len(ranks), parallelism.strategy
    budget = min(i.budget_bytes or 0 for i in infos)
    shard = parallelism.shard_size or host_shard_size([r.node_id for r in ranks])
    decide_for = world
    if shard and not splits_into_shard_groups(world, shard):  # an elastic start below max
        if requested == "auto":
            shard = None  # no whole shard groups to consider
        elif requested == "hsdp":
            decide_for = max_workers
    comm = placer.comm_costs() if world == max_workers and shard else None
    on_gpu = infos[0].device.startswith("cuda")
    if parallelism.offload is True and not on_gpu:
        raise ValueError(
            f"offload=True: the ranks run on {infos[0].device}; offload moves FSDP's state "
            "from GPU to host memory, so it needs GPU ranks (gpus=True); drop it on CPU"
        )
    decision = policy.decide(
        requested,
        estimate,
        decide_for,
        budget,
        shard_size=shard,
        comm=comm,
        checkpointing=parallelism.activation_checkpointing,
        offload=parallelism.offload if on_gpu else False,
        precision=precision,
    )
    check_fp16(precision, decision.strategy)
    return decision
