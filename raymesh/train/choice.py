"""The choice of a parallel strategy as data: `Figures`, the numbers one decision is made from
(each computed once), and `judge`, the pure choice over them, whose `Verdict` says what was
taken and what was set aside, with no words (`raymesh.train.memory_text` writes those;
`raymesh.train.strategy` checks the request, asks, and carries the verdict out).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, cast

from raymesh.train.estimate import MemoryEstimate

__all__ = ["Figures", "Fit", "Sharding", "Verdict", "judge"]

Sharding = Literal["ddp", "fsdp", "hsdp"]
Fit = Literal["fits", "over_headroom", "over_budget", "no_fit", "too_big"]


@dataclass(frozen=True, kw_only=True)
class Figures:
    """The numbers one decision is made from, each computed once: what a rank needs under
    each strategy (bytes per rank, with this combination's checkpointing and offload) and
    what it may use. Plain data: `judge` decides from it, `memory_text` words it."""

    full: MemoryEstimate  # as measured: no checkpointing, no offload
    estimate: MemoryEstimate  # under this combination's checkpointing and offload
    on_device: MemoryEstimate  # checkpointing only: DDP keeps its state on the device
    world_size: int
    shard_size: int | None  # HSDP's ranks per group; None: no shard groups
    budget_bytes: int
    headroom: float
    limit: int  # int(headroom * budget_bytes): what the estimate may use
    checkpointing: bool
    offload: bool
    comm: Mapping[str, float] | None  # the planner's seconds per step, by strategy
    ddp: int
    fsdp: int  # sharded over every rank
    hsdp: int | None  # sharded within a shard group; None without shard groups

    @classmethod
    def of(
        cls,
        full: MemoryEstimate,
        world_size: int,
        budget_bytes: int,
        *,
        headroom: float,
        shard_size: int | None,
        comm: Mapping[str, float] | None,
        checkpointing: bool,
        offload: bool,
    ) -> Figures:
        """The figures of `full` over `world_size` ranks of `budget_bytes` each."""
        estimate = full.under(checkpointing=checkpointing, offload=offload)
        # DDP keeps its state on the device: offload does not apply to it.
        on_device = full.under(checkpointing=checkpointing, offload=False)
        return cls(
            full=full,
            estimate=estimate,
            on_device=on_device,
            world_size=world_size,
            shard_size=shard_size,
            budget_bytes=budget_bytes,
            headroom=headroom,
            limit=int(headroom * budget_bytes),
            checkpointing=checkpointing,
            offload=offload,
            comm=comm,
            ddp=on_device.ddp_bytes(),
            fsdp=estimate.fsdp_bytes(world_size),
            hsdp=estimate.fsdp_bytes(shard_size) if shard_size else None,
        )


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What one decision came to, as data (its words are `memory_text.reason`/`no_fit`).

    fit: "fits" (within the limit), "over_headroom" (forced, within the whole budget),
    "over_budget" (forced, over the whole budget: expect out-of-memory), "no_fit" (nothing
    asked for fits the limit), "too_big" (over the whole budget under every strategy, decided
    before any strategy is tried). strategy: the one taken, or the forced one that does not
    fit; None when "auto" takes none. passed_over: the strategies "auto" tried before its
    choice and set aside as over the limit (DDP also under offload, which it cannot take),
    every one it tried when none fits; empty for a forced strategy."""

    fit: Fit
    strategy: Sharding | None
    passed_over: tuple[Sharding, ...] = ()


def judge(requested: str, f: Figures, *, must_fit: bool) -> Verdict:
    """What a checked `requested` comes to under `f`; pure. "auto" takes the first of DDP,
    HSDP, FSDP that fits the limit (DDP not under offload; HSDP only with shard groups and
    unless `comm` rates FSDP cheaper). A forced strategy is taken over the limit, even over
    the whole budget, unless `must_fit`. Over the whole budget under every strategy (FSDP
    alone under offload) is "too_big", whatever was requested."""
    forced = None if requested == "auto" else cast(Sharding, requested)
    if (f.fsdp if f.offload else min(f.ddp, f.fsdp)) > f.budget_bytes:
        return Verdict(fit="too_big", strategy=forced)
    if forced is not None:
        need = {"ddp": f.ddp, "fsdp": f.fsdp, "hsdp": f.hsdp}[forced]
        assert need is not None  # hsdp without shard groups was refused by _check_request
        if need <= f.limit:
            return Verdict(fit="fits", strategy=forced)
        if must_fit:
            return Verdict(fit="no_fit", strategy=forced)
        over: Fit = "over_headroom" if need <= f.budget_bytes else "over_budget"
        return Verdict(fit=over, strategy=forced)
    if f.ddp <= f.limit and not f.offload:
        return Verdict(fit="fits", strategy="ddp")
    hsdp_cheaper = f.comm is None or f.comm.get("hsdp", 0.0) <= f.comm.get("fsdp", math.inf)
    if f.hsdp is not None and f.hsdp <= f.limit and hsdp_cheaper:
        return Verdict(fit="fits", strategy="hsdp", passed_over=("ddp",))
    if f.fsdp <= f.limit:
        # Passed over for size only: HSDP set aside by `comm` shows why in the comm figures.
        hsdp_over: tuple[Sharding, ...] = (
            ("hsdp",) if f.hsdp is not None and f.hsdp > f.limit else ()
        )
        return Verdict(fit="fits", strategy="fsdp", passed_over=("ddp", *hsdp_over))
    tried: tuple[Sharding, ...] = ("ddp", "hsdp", "fsdp") if f.hsdp is not None else ("ddp", "fsdp")
    return Verdict(fit="no_fit", strategy=None, passed_over=tried)
