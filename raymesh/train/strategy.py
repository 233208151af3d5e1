"""DDP, FSDP2 or HSDP for one job: the decision, pure arithmetic, returned as data.

Decide, estimate, apply are three modules (as torchtitan splits parallel_dims.py from
parallelize.py): `raymesh.train.estimate` measures what one rank holds (a `MemoryEstimate`,
from the model), this module decides from those numbers alone, and `raymesh.train.rank.parallelize`
wraps the model as decided. `StrategyPolicy.decide()` compares the estimate with the rank's
memory budget and returns a `StrategyDecision` whose `reason` shows the arithmetic; the
controller logs the reason and carries the decision out. Inside, the numbers (`Figures`) are
computed once, `judge` decides from them alone (a `Verdict`, no words), and
`raymesh.train.memory_text` writes the reason and the errors from those two. Nothing here
touches a model or a process group, so every rule is unit-tested with made-up numbers.

The rule (`strategy="auto"`): replicate (DDP) when everything fits in `headroom` of the budget;
else, when the ranks form shard groups (`shard_size`: one host's ranks each, or the config's),
HSDP when sharding within a group fits: FSDP2 inside each group, replicas across groups, so
only an all-reduce of 1/shard_size of the gradients crosses hosts instead of every all-gather
and reduce-scatter; else shard over every rank (FSDP2, `fully_shard` per block) when that fits;
else fail before training with the numbers and the fix. Between HSDP and FSDP the planner's
communication estimate, when given, has the last word. `"ddp"`/`"fsdp"`/`"hsdp"` force the
choice, and the reason says if it exceeds the budget; a job too big for the budget under every
strategy always fails.

`headroom` (default 80%) is the allowance for what the estimate leaves out (allocator
fragmentation, communication buckets, the CUDA context).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from raymesh.train import memory_text as text
from raymesh.train.choice import Figures, judge
from raymesh.train.estimate import MemoryEstimate

__all__ = [
    "StrategyDecision",
    "StrategyPolicy",
    "host_shard_size",
    "splits_into_shard_groups",
]


_REQUESTS = ("auto", "ddp", "fsdp", "hsdp")


@dataclass(frozen=True)
class StrategyDecision:
    """What to wrap the model in, and why (the reason carries the arithmetic, for the log)."""

    strategy: Literal["ddp", "fsdp", "hsdp"]
    reason: str
    estimate: MemoryEstimate
    budget_bytes: int
    shard_size: int | None = None  # HSDP: ranks per shard group (replicas: world / shard_size)
    checkpointing: bool = False  # activation checkpointing per block
    offload: bool = False  # FSDP's state in host memory (GPU ranks)

    @property
    def sharded(self) -> bool:
        """True when no rank holds the whole state (FSDP, HSDP): a lost rank's shard is
        restored from a replica (HSDP) or a checkpoint, not from any one peer."""
        return self.strategy != "ddp"

    def mesh(self, world_size: int) -> tuple[int, int] | None:
        """HSDP's (replicate, shard) device mesh for `world_size` ranks; None otherwise.
        Rank r is replica r // shard_size, shard r % shard_size: a shard group is contiguous
        ranks (one host's, as placed), a replicate group ranks shard_size apart."""
        if self.strategy != "hsdp":
            return None
        assert self.shard_size is not None  # set with "hsdp" by StrategyPolicy
        if world_size % self.shard_size:
            raise ValueError(
                f"hsdp: world_size {world_size} is not a multiple of shard_size "
                f"{self.shard_size}; use resized() for a new world"
            )
        return world_size // self.shard_size, self.shard_size

    def resized(self, world_size: int) -> StrategyDecision:
        """This decision for an elastic job's new world: HSDP stays HSDP while `world_size`
        still splits into two or more whole shard groups, else it becomes FSDP over every rank
        (whose shards are no larger while world_size >= shard_size). DDP and FSDP are
        unchanged."""
        if self.strategy != "hsdp":
            return self
        assert self.shard_size is not None
        if splits_into_shard_groups(world_size, self.shard_size):
            return self
        reason = (
            f"fsdp over {text.ranks(world_size)}: the world of {world_size} no longer splits into "
            f"shard groups of {self.shard_size} (was: {self.reason})"
        )
        return dataclasses.replace(self, strategy="fsdp", shard_size=None, reason=reason)


class StrategyPolicy:
    """Chooses DDP, HSDP or FSDP for one job; returns the choice as data, with its reason."""

    def __init__(self, headroom: float = 0.8) -> None:
        """headroom: the fraction of the budget an estimate may use (the rest covers what the
        estimate leaves out: allocator slack, communication buffers, the CUDA context)."""
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom={headroom}: must be in (0, 1], e.g. 0.8")
        self.headroom = headroom

    def decide(
        self,
        requested: str,
        estimate: MemoryEstimate,
        world_size: int,
        budget_bytes: int,
        *,
        shard_size: int | None = None,
        comm: Mapping[str, float] | None = None,
        checkpointing: bool | Literal["auto"] = False,
        offload: bool | Literal["auto"] = False,
        precision: str = "fp32",
    ) -> StrategyDecision:
        """The strategy, activation checkpointing and offload for `world_size` ranks of
        `budget_bytes` each: the first combination, in order of cost, under which the job
        fits `headroom` of the budget (the sharding rule below applied to each).

        The order: neither; activation checkpointing (about a third more compute); offload
        (copies to and from host memory every step, GPU ranks, FSDP/HSDP only); both.
        `checkpointing` and `offload` True or False fix that choice; "auto" lets it be
        chosen. Checkpointing needs the estimate's `checkpointed_activation_bytes` (a model
        with blocks). When no combination fits, the error gives the numbers of the first
        and of the cheapest, and what would fit (more ranks, bf16, LoRA, more memory).
        `precision` only shapes those hints: it changes the numbers a model learns, so it
        stays the user's choice."""
        can_checkpoint = estimate.checkpointed_activation_bytes is not None
        if checkpointing is True and not can_checkpoint:
            raise ValueError(
                "activation_checkpointing=True: the model has no blocks to checkpoint (raymesh "
                "checkpoints the modules of its first nn.ModuleList); drop it, or keep the "
                "transformer blocks in an nn.ModuleList"
            )
        variants = [
            (ac, off)
            for off in (False, True)
            for ac in (False, True)
            if (checkpointing == "auto" or ac == checkpointing)
            and (offload == "auto" or off == offload)
            and (can_checkpoint or not ac)
            and not (off and requested == "ddp")
        ]
        if not variants:
            raise ValueError("offload=True needs a sharded strategy; use 'fsdp' or 'auto'")

        def attempt(ac: bool, off: bool, must_fit: bool) -> StrategyDecision:
            return self._decide(
                requested,
                estimate,
                world_size,
                budget_bytes,
                shard_size=shard_size,
                comm=comm,
                checkpointing=ac,
                offload=off,
                must_fit=must_fit,
            )

        for ac, off in variants:
            try:
                return attempt(ac, off, must_fit=True)
            except _NoFit:
                continue
        ac, off = variants[-1]  # none fits: the least memory, and its numbers
        try:
            return attempt(ac, off, must_fit=False)
        except _NoFit as e:
            tried = " and ".join(
                x for x, on in (("activation checkpointing", ac), ("offload", off)) if on
            )
            hints = text.hints(estimate, ac, off, world_size, precision)
            raise ValueError(
                (f"with {tried}, " if tried else "") + str(e) + (f"; or: {hints}" if hints else "")
            ) from None

    def _decide(
        self,
        requested: str,
        full: MemoryEstimate,
        world_size: int,
        budget_bytes: int,
        *,
        shard_size: int | None,
        comm: Mapping[str, float] | None,
        checkpointing: bool,
        offload: bool,
        must_fit: bool,
    ) -> StrategyDecision:
        """The strategy for `world_size` ranks of `budget_bytes` each, with `checkpointing`
        and `offload` as given (`_NoFit` when it does not fit and `must_fit`, or nothing does).

        shard_size: HSDP's shard groups (ranks r*shard_size .. r*shard_size+shard_size-1, e.g.
        one host's), or None when there are none (one host, uneven hosts): then "auto" never
        picks HSDP and "hsdp" raises ValueError. comm: the planner's estimated communication
        seconds per step by strategy, for the reason and to choose between HSDP and FSDP.

        "auto": DDP when ddp_bytes <= headroom * budget; else HSDP when the shard groups'
        fsdp_bytes(shard_size) does (and `comm` does not rate FSDP cheaper); else FSDP when
        fsdp_bytes(world_size) does; else ValueError. "ddp"/"fsdp"/"hsdp": that strategy, with
        the reason noting any excess over the budget. Under every request, a job that exceeds
        the whole budget with every strategy raises ValueError before training, with the
        numbers and the ways out.
        """
        _check_request(requested, world_size, budget_bytes, shard_size)
        figures = Figures.of(
            full,
            world_size,
            budget_bytes,
            headroom=self.headroom,
            shard_size=shard_size,
            comm=comm,
            checkpointing=checkpointing,
            offload=offload,
        )
        verdict = judge(requested, figures, must_fit=must_fit)
        if verdict.fit in ("no_fit", "too_big"):
            raise _NoFit(text.no_fit(figures, verdict))
        assert verdict.strategy is not None  # every other verdict names the strategy taken
        return StrategyDecision(
            strategy=verdict.strategy,
            reason=text.reason(figures, verdict),
            estimate=figures.estimate,
            budget_bytes=budget_bytes,
            shard_size=shard_size if verdict.strategy == "hsdp" else None,
            checkpointing=checkpointing,
            offload=offload,
        )


class _NoFit(ValueError):
    """The job does not fit under one combination (the policy tries the next)."""


def _check_request(
    requested: str, world_size: int, budget_bytes: int, shard_size: int | None
) -> None:
    """Raises ValueError, naming the fix, unless `requested` is a strategy this module knows,
    the world and the budget are positive, and `shard_size` (when given) splits the world into
    HSDP shard groups; "hsdp" needs shard groups."""
    if requested not in _REQUESTS:
        raise ValueError(f"strategy={requested!r}: use one of {list(_REQUESTS)}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: must be >= 1")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes={budget_bytes}: must be > 0")
    if shard_size is not None and not splits_into_shard_groups(world_size, shard_size):
        most = world_size // 2
        fits = (
            f"a divisor of the world size {world_size} between 2 and {most}"
            if most >= 2
            else f"a world of at least 4 ranks, not {world_size}"
        )
        raise ValueError(
            f"shard_size={shard_size}: HSDP needs at least 2 shard groups of at least 2 "
            f"ranks, so {fits}"
        )
    if requested == "hsdp" and shard_size is None:
        raise ValueError(
            f"strategy='hsdp' over {text.ranks(world_size)} has no shard groups: set "
            "shard_size (ranks per group, a divisor of workers), or run on hosts that "
            "each hold the same number (>= 2) of ranks, one group per host"
        )


def splits_into_shard_groups(world_size: int, shard_size: int) -> bool:
    """True when `world_size` ranks form two or more whole HSDP shard groups of `shard_size`
    (>= 2) ranks each: fewer groups, or groups of one rank, are FSDP or DDP."""
    return shard_size >= 2 and world_size % shard_size == 0 and world_size > shard_size


def host_shard_size(node_ids: Sequence[str]) -> int | None:
    """HSDP's natural shard group for ranks placed on `node_ids` (rank order): the ranks of one
    host, when the ranks fill two or more hosts in contiguous blocks of the same size (>= 2);
    else None (one host, uneven hosts, or a host's ranks not next to each other)."""
    blocks: list[tuple[str, int]] = []
    for node in node_ids:
        if blocks and blocks[-1][0] == node:
            blocks[-1] = (node, blocks[-1][1] + 1)
        else:
            blocks.append((node, 1))
    sizes = {n for _, n in blocks}
    hosts = {node for node, _ in blocks}
    if len(blocks) < 2 or len(hosts) != len(blocks) or len(sizes) != 1:
        return None
    size = sizes.pop()
    return size if size >= 2 else None
