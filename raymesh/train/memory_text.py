"""The memory arithmetic of a strategy decision, in words: what its reason and its errors say
(the sums of each strategy, the ways out when nothing fits), written from the decision's data
alone (its `Figures` and `Verdict`). Kept apart from `raymesh.train.strategy`, which decides,
so that the rules read without the wording."""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from raymesh.train.estimate import MemoryEstimate

if TYPE_CHECKING:
    from raymesh.train.choice import Figures, Sharding, Verdict

__all__ = [
    "ddp_sum",
    "fixes",
    "fmt",
    "fsdp_sum",
    "hints",
    "no_fit",
    "ranks",
    "reason",
    "unit",
]

_GIB = 1 << 30


def reason(f: Figures, v: Verdict) -> str:
    """`StrategyDecision.reason` for a verdict that takes a strategy: its name, its sum, how it
    stands against the budget, then what checkpointing, offload and communication add."""
    assert v.strategy is not None  # only "no_fit" and "too_big" take none
    u = _terms_unit(f)
    return f"{_name(f, v.strategy)}: {_sum(f, v.strategy, u)} {_why(f, v, u)}" + _extras(
        f, v.strategy, u
    )


def no_fit(f: Figures, v: Verdict) -> str:
    """The error of a verdict that takes nothing ("too_big", or "no_fit"): the numbers of each
    strategy weighed and, but for a forced strategy under the limit, the ways out."""
    u = _terms_unit(f)
    fix = fixes(f.estimate, f.world_size, f.budget_bytes, f.headroom)
    if v.fit == "too_big":
        return (
            f"the job does not fit in memory even sharded: {ddp_sum(f.on_device, u)} with ddp, "
            f"{fsdp_sum(f.estimate, f.world_size, u)} with fsdp over {ranks(f.world_size)}, "
            f"both above the per-rank budget of {fmt(f.budget_bytes, unit(f.budget_bytes))}; "
            f"{fix}"
        )
    if v.strategy is not None:  # forced: the policy tries its next combination
        return f"{v.strategy} does not fit {_budget(f)}"
    hsdp = (
        f", hsdp over groups of {f.shard_size} needs {_sum(f, 'hsdp', u)}"
        if "hsdp" in v.passed_over
        else ""
    )
    return (
        f"the job does not fit {_budget(f)}: ddp needs {_sum(f, 'ddp', u)}, "
        f"fsdp over {ranks(f.world_size)} needs {_sum(f, 'fsdp', u)}{hsdp}; {fix}"
    )


def _terms_unit(f: Figures) -> tuple[str, int]:
    # One unit for every term of a message, so that its sums add up as written.
    return unit(max(f.ddp, f.fsdp))


def _budget(f: Figures) -> str:
    bunit = unit(f.budget_bytes)
    whole, part = fmt(f.budget_bytes, bunit), fmt(f.limit, bunit)
    return f"{f.headroom * 100:g}% of the {whole} budget ({part})"


def _name(f: Figures, strategy: Sharding) -> str:
    if strategy != "hsdp":
        return strategy
    assert f.shard_size is not None  # "hsdp" is taken only with shard groups
    groups = f.world_size // f.shard_size
    return (
        f"hsdp {groups}x{f.shard_size} (sharded within groups of {f.shard_size}, "
        f"replicated across {groups})"
    )


def _sum(f: Figures, strategy: Sharding, u: tuple[str, int]) -> str:
    if strategy == "ddp":
        return ddp_sum(f.on_device, u)
    if strategy == "hsdp":
        assert f.shard_size is not None
        return fsdp_sum(f.estimate, f.shard_size, u)
    return fsdp_sum(f.estimate, f.world_size, u)


def _why(f: Figures, v: Verdict, u: tuple[str, int]) -> str:
    if v.fit == "fits":
        why = f"fits {_budget(f)}"
        if "ddp" in v.passed_over:
            why += f"; ddp would need {fmt(f.ddp, u)}"
        if "hsdp" in v.passed_over:
            assert f.hsdp is not None
            why += f", hsdp over groups of {f.shard_size} {fmt(f.hsdp, u)}"
        return why
    if v.fit == "over_headroom":
        return f"exceeds {_budget(f)} (forced by strategy={v.strategy!r})"
    return (
        f"exceeds the whole {fmt(f.budget_bytes, unit(f.budget_bytes))} budget "
        f"(forced by strategy={v.strategy!r}; expect out-of-memory)"
    )


def _extras(f: Figures, strategy: Sharding, u: tuple[str, int]) -> str:
    out = ""
    if f.checkpointing:
        out += (
            f"; activation checkpointing per block (activations "
            f"{fmt(f.full.activation_bytes, u)} -> {fmt(f.estimate.activation_bytes, u)})"
        )
    if f.offload:
        out += f"; offload: {fmt(f.estimate.host_bytes, u)} of state in host memory"
    if f.comm and strategy in f.comm:
        others = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in f.comm.items() if k != strategy)
        out += f"; estimated communication {f.comm[strategy] * 1e3:.3g} ms per step" + (
            f" (vs {others})" if others else ""
        )
    return out


def hints(e: MemoryEstimate, ac: bool, off: bool, world_size: int, precision: str) -> str:
    """What the user may change that the planner may not, with about what it would need:
    bf16 about halves activations and the gathered block; LoRA drops the base's gradients
    and optimizer state."""
    cheapest = e.under(checkpointing=ac, offload=off)
    u = unit(e.ddp_bytes())
    out = []
    if precision == "fp32":  # about half the activations and of the gathered block
        bf16 = dataclasses.replace(
            cheapest,
            activation_bytes=cheapest.activation_bytes // 2,
            largest_block_bytes=cheapest.largest_block_bytes // 2,
        )
        out.append(f"precision='bf16' would need about {fmt(bf16.fsdp_bytes(world_size), u)}")
    if e.grad_bytes:  # LoRA: the base frozen, no gradients or optimizer state for it
        lora = dataclasses.replace(cheapest, grad_bytes=0, optimizer_bytes=0)
        out.append(
            f"LoRA (a frozen base, small adapters) would need about "
            f"{fmt(min(lora.ddp_bytes(), lora.fsdp_bytes(world_size)), u)}"
        )
    return "; ".join(out) if out else ""


def ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def unit(nbytes: int) -> tuple[str, int]:
    for name, size in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return name, size
    return "B", 1


def fmt(nbytes: int, unit: tuple[str, int], with_unit: bool = True) -> str:
    name, size = unit
    text = f"{nbytes / size:.2f}" if size > 1 else str(nbytes)
    return f"{text} {name}" if with_unit else text


def ddp_sum(e: MemoryEstimate, unit: tuple[str, int]) -> str:
    return (
        f"{fmt(e.ddp_bytes(), unit)} per rank (params {fmt(e.param_bytes, unit, False)}"
        f" + grads {fmt(e.grad_bytes, unit, False)}"
        f" + optimizer {fmt(e.optimizer_bytes, unit, False)}"
        f" + activations {fmt(e.activation_bytes, unit, False)})"
    )


def fsdp_sum(e: MemoryEstimate, world_size: int, unit: tuple[str, int]) -> str:
    states = e.param_bytes + e.grad_bytes + e.optimizer_bytes
    return (
        f"{fmt(e.fsdp_bytes(world_size), unit)} per rank "
        f"((params {fmt(e.param_bytes, unit, False)} + grads {fmt(e.grad_bytes, unit, False)}"
        f" + optimizer {fmt(e.optimizer_bytes, unit, False)}"
        f" = {fmt(states, unit, False)}) / {ranks(world_size)}"
        f" + largest block {fmt(e.largest_block_bytes, unit, False)}"
        f" + activations {fmt(e.activation_bytes, unit, False)})"
    )


def fixes(e: MemoryEstimate, world_size: int, budget_bytes: int, headroom: float) -> str:
    """The ways out, with the numbers that would make the job fit."""
    limit = int(headroom * budget_bytes)
    states = e.param_bytes + e.grad_bytes + e.optimizer_bytes
    room = limit - e.largest_block_bytes - e.activation_bytes
    fixes = []
    if room > 0:
        fixes.append(f"use at least {math.ceil(states / room)} workers (now {world_size})")
    else:
        fixes.append("more workers cannot help: activations and one block alone exceed the limit")
    fixes.append("shrink the model or the per-rank batch (activation_bytes)")
    best = min(("ddp", e.ddp_bytes()), ("fsdp", e.fsdp_bytes(world_size)), key=lambda c: c[1])
    if best[1] <= budget_bytes:  # fits the budget itself, only not the headroom
        fixes.append(f"force strategy={best[0]!r} to use {best[1] / budget_bytes:.0%} of it")
    need = math.ceil(min(e.ddp_bytes(), e.fsdp_bytes(world_size)) / headroom / _GIB * 100) / 100
    fixes.append(f"give each rank at least {need:.2f} GiB (memory_budget_gb on CPU)")
    return "fix: " + ", or ".join(fixes)
