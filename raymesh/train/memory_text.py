"""The memory arithmetic of a strategy decision, in words: what its reason and its errors say
(the sums of each strategy, the ways out when nothing fits). Kept apart from
`raymesh.train.strategy`, which decides, so that the rules read without the wording."""

from __future__ import annotations

import dataclasses
import math

from raymesh.train.estimate import MemoryEstimate

__all__ = ["ddp_sum", "fixes", "fmt", "fsdp_sum", "hints", "ranks", "unit"]

_GIB = 1 << 30


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
