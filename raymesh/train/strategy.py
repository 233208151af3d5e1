"""DDP or FSDP2, chosen from a per-rank memory estimate: pure arithmetic, decisions as data.

`estimate()` adds up what one rank holds (parameters, gradients, optimizer state, activations);
`StrategyPolicy.decide()` compares it with the rank's memory budget and returns a
`StrategyDecision` whose `reason` shows the arithmetic. The controller logs the reason and
carries the decision out; nothing here touches a process group, so every rule is unit-tested
without one.

The rule (`strategy="auto"`): replicate (DDP) when everything fits in `headroom` of the budget,
else shard (FSDP2, `fully_shard` per block) when the sharded footprint fits, else fail before
training with the numbers and the fix. `"ddp"`/`"fsdp"` force the choice, and the reason says if
it exceeds the budget; a job too big for the budget under either strategy always fails.

The estimate is deliberately simple (no allocator fragmentation, no communication buckets, no
CUDA context); `headroom` (default 80%) is the allowance for everything it leaves out.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "MemoryEstimate",
    "StrategyDecision",
    "StrategyPolicy",
    "cpu_budget_bytes",
    "estimate",
    "fsdp_blocks",
    "gpu_budget_bytes",
    "largest_block_bytes",
    "probe_activation_bytes",
]


_GIB = 1 << 30
_REQUESTS = ("auto", "ddp", "fsdp")


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, before any sharding.

    largest_block_bytes is FSDP's allowance for one unit's parameters gathered unsharded during
    its all-gather (see `largest_block_bytes()`); it does not count towards DDP.
    """

    param_bytes: int  # every parameter, at its own dtype
    grad_bytes: int  # trainable parameters only, same dtype as the parameter
    optimizer_bytes: int  # optimizer state, by optimizer type (see `estimate`)
    activation_bytes: int  # saved for backward in one micro-batch (measured or the user's hint)
    largest_block_bytes: int = 0  # biggest FSDP unit's parameters, gathered during all-gather

    def ddp_bytes(self) -> int:
        """Everything replicated on every rank."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def sharded_bytes(self, world_size: int) -> int:
        """This rank's 1/world_size share of params, grads and optimizer state (rounded up)."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        states = self.param_bytes + self.grad_bytes + self.optimizer_bytes
        return math.ceil(states / world_size)

    def fsdp_bytes(self, world_size: int) -> int:
        """Params, grads and optimizer state sharded 1/world_size, plus one unsharded block.

        Activations are not sharded (each rank runs its own micro-batch). The block allowance is
        one unit's parameters during its all-gather; FSDP2's prefetch of the next unit and the
        block's unsharded gradients before reduce-scatter are left to the headroom.
        """
        return self.sharded_bytes(world_size) + self.largest_block_bytes + self.activation_bytes


@dataclass(frozen=True)
class StrategyDecision:
    """What to wrap the model in, and why (the reason carries the arithmetic, for the log)."""

    strategy: Literal["ddp", "fsdp"]
    reason: str
    estimate: MemoryEstimate
    budget_bytes: int


def _param_bytes(params: Iterator[torch.nn.Parameter] | list[torch.nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _optimizer_state_factor(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """How many param-sized state tensors `optimizer` keeps for each param of `group`.

    Known optimizers are counted exactly (scalar `step` tensors are ignored); an unknown one is
    assumed to keep 2 (as Adam does), a deliberately cautious guess.
    """
    adam_like = (torch.optim.Adam, torch.optim.AdamW)
    if isinstance(optimizer, adam_like):
        return 3 if group.get("amsgrad", False) else 2  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0  # momentum_buffer
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1  # sum
    if isinstance(optimizer, torch.optim.RMSprop):
        # square_avg (+ momentum_buffer) (+ grad_avg when centered)
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    return 2  # NAdam, RAdam, Adamax keep two; anything unknown is assumed to as well


def estimate(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, activation_bytes: int
) -> MemoryEstimate:
    """Per-rank bytes of `model` trained by `optimizer`, unsharded.

    Guarantees: each tensor is counted at its own dtype's size; a parameter shared by several
    modules (weight tying) is counted once; gradients are counted for trainable params only;
    optimizer state for the params in `optimizer`'s groups, by type: Adam/AdamW 2x (3x with
    amsgrad), SGD 1x with momentum and 0x without, Adagrad 1x, RMSprop 1-3x, NAdam/RAdam/Adamax
    2x, anything else 2x. Buffers (e.g. BatchNorm statistics) are not counted.
    """
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes={activation_bytes}: must be >= 0")
    params = list(model.parameters())  # parameters() yields a tied parameter once
    seen: set[int] = set()
    optimizer_bytes = 0
    for group in optimizer.param_groups:
        factor = _optimizer_state_factor(optimizer, group)
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            optimizer_bytes += factor * p.numel() * p.element_size()
    return MemoryEstimate(
        param_bytes=_param_bytes(params),
        grad_bytes=_param_bytes([p for p in params if p.requires_grad]),
        optimizer_bytes=optimizer_bytes,
        activation_bytes=int(activation_bytes),
        largest_block_bytes=largest_block_bytes(model),
    )


def fsdp_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP wraps one by one: the children of the first nn.ModuleList found (in
    `modules()` order), or [] when the model has none (then only the root is wrapped)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def largest_block_bytes(model: torch.nn.Module) -> int:
    """Biggest parameter footprint among the units FSDP would gather at once.

    The units are the children of the first nn.ModuleList (`fsdp_blocks`) and the root, which
    owns every parameter outside them (embeddings, heads); with no ModuleList the root is the
    whole model.
    """
    blocks = fsdp_blocks(model)
    in_blocks: set[int] = set()
    sizes = [0]
    for block in blocks:
        block_params = [p for p in block.parameters() if id(p) not in in_blocks]
        in_blocks.update(id(p) for p in block_params)
        sizes.append(_param_bytes(block_params))
    sizes.append(_param_bytes([p for p in model.parameters() if id(p) not in in_blocks]))
    return max(sizes)


def probe_activation_bytes(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
) -> int:
    """Bytes autograd saves for backward in one forward of `loss_fn(model, batch)`.

    Works on CPU and GPU alike (it counts saved tensors, not allocator statistics). Each storage
    is counted once, whole; the model's own parameters are excluded (they are in param_bytes).
    The probe runs no backward and leaves no trace: the RNG streams and the model's buffers
    (e.g. BatchNorm running statistics) are restored, so a run that probes trains exactly like
    one that does not.
    """
    param_storages = {
        p.untyped_storage().data_ptr() for p in model.parameters() if p.device.type != "meta"
    }
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        try:
            storage = t.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            key, nbytes = id(t), t.numel() * t.element_size()
        if key not in param_storages and key not in seen:
            seen.add(key)
            total += nbytes
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    rng = torch.random.fork_rng(devices=devices)  # the CPU stream, plus the model's GPUs
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    with rng, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        loss = loss_fn(model, batch)
        del loss  # frees the graph and everything it saved
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return total


class StrategyPolicy:
    """Chooses DDP or FSDP for one job; returns the choice as data and logs its reason."""

    def __init__(self, headroom: float = 0.8) -> None:
        """headroom: the fraction of the budget an estimate may use (the rest covers what the
        estimate leaves out: allocator slack, communication buffers, the CUDA context)."""
        if not 0 < headroom <= 1:
            raise ValueError(f"headroom={headroom}: must be in (0, 1], e.g. 0.8")
        self.headroom = headroom

    def decide(
        self, requested: str, estimate: MemoryEstimate, world_size: int, budget_bytes: int
    ) -> StrategyDecision:
        """The strategy for `world_size` ranks of `budget_bytes` each.

        "auto": DDP when ddp_bytes <= headroom * budget, else FSDP when fsdp_bytes does, else
        ValueError. "ddp"/"fsdp": that strategy, with the reason noting any excess over the
        budget. Under every request, a job that exceeds the whole budget with both strategies
        raises ValueError before training, with the numbers and the ways out.
        """
        if requested not in _REQUESTS:
            raise ValueError(f"strategy={requested!r}: use one of {list(_REQUESTS)}")
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes={budget_bytes}: must be > 0")
        ddp, fsdp = estimate.ddp_bytes(), estimate.fsdp_bytes(world_size)
        limit = int(self.headroom * budget_bytes)
        unit = _unit(max(ddp, fsdp))  # the estimate's terms share one unit so they add up
        bunit = _unit(budget_bytes)
        budget = f"{self._pct()} of the {_fmt(budget_bytes, bunit)} budget ({_fmt(limit, bunit)})"

        if min(ddp, fsdp) > budget_bytes:
            raise ValueError(
                f"the job does not fit in memory even sharded: "
                f"{_ddp_sum(estimate, unit)} with ddp, "
                f"{_fsdp_sum(estimate, world_size, unit)} with fsdp over {_ranks(world_size)}, "
                f"both above the per-rank budget of {_fmt(budget_bytes, bunit)}; "
                f"{_fixes(estimate, world_size, budget_bytes, self.headroom)}"
            )
        chosen: Literal["ddp", "fsdp"]
        if requested == "auto":
            if ddp <= limit:
                chosen, reason = "ddp", f"ddp: {_ddp_sum(estimate, unit)} fits {budget}"
            elif fsdp <= limit:
                chosen = "fsdp"
                reason = (
                    f"fsdp: {_fsdp_sum(estimate, world_size, unit)} fits {budget}; "
                    f"ddp would need {_fmt(ddp, unit)}"
                )
            else:
                raise ValueError(
                    f"the job does not fit {budget}: ddp needs {_ddp_sum(estimate, unit)}, "
                    f"fsdp over {_ranks(world_size)} needs "
                    f"{_fsdp_sum(estimate, world_size, unit)}; "
                    f"{_fixes(estimate, world_size, budget_bytes, self.headroom)}"
                )
        else:
            chosen = "ddp" if requested == "ddp" else "fsdp"
            need = ddp if chosen == "ddp" else fsdp
            total = (
                _ddp_sum(estimate, unit)
                if chosen == "ddp"
                else _fsdp_sum(estimate, world_size, unit)
            )
            if need <= limit:
                verdict = f"fits {budget}"
            elif need <= budget_bytes:
                verdict = f"exceeds {budget} (forced by strategy={requested!r})"
            else:
                verdict = (
                    f"exceeds the whole {_fmt(budget_bytes, bunit)} budget "
                    f"(forced by strategy={requested!r}; expect out-of-memory)"
                )
            reason = f"{chosen}: {total} {verdict}"
        return StrategyDecision(
            strategy=chosen, reason=reason, estimate=estimate, budget_bytes=budget_bytes
        )

    def _pct(self) -> str:
        return f"{self.headroom * 100:g}%"


def _ranks(n: int) -> str:
    return f"{n} rank" if n == 1 else f"{n} ranks"


def _unit(nbytes: int) -> tuple[str, int]:
    for name, size in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return name, size
    return "B", 1


def _fmt(nbytes: int, unit: tuple[str, int], with_unit: bool = True) -> str:
    name, size = unit
    text = f"{nbytes / size:.2f}" if size > 1 else str(nbytes)
    return f"{text} {name}" if with_unit else text


def _ddp_sum(e: MemoryEstimate, unit: tuple[str, int]) -> str:
    return (
        f"{_fmt(e.ddp_bytes(), unit)} per rank (params {_fmt(e.param_bytes, unit, False)}"
        f" + grads {_fmt(e.grad_bytes, unit, False)}"
        f" + optimizer {_fmt(e.optimizer_bytes, unit, False)}"
        f" + activations {_fmt(e.activation_bytes, unit, False)})"
    )


def _fsdp_sum(e: MemoryEstimate, world_size: int, unit: tuple[str, int]) -> str:
    states = e.param_bytes + e.grad_bytes + e.optimizer_bytes
    return (
        f"{_fmt(e.fsdp_bytes(world_size), unit)} per rank "
        f"((params {_fmt(e.param_bytes, unit, False)} + grads {_fmt(e.grad_bytes, unit, False)}"
        f" + optimizer {_fmt(e.optimizer_bytes, unit, False)}"
        f" = {_fmt(states, unit, False)}) / {_ranks(world_size)}"
        f" + largest block {_fmt(e.largest_block_bytes, unit, False)}"
        f" + activations {_fmt(e.activation_bytes, unit, False)})"
    )


def _fixes(e: MemoryEstimate, world_size: int, budget_bytes: int, headroom: float) -> str:
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


def cpu_budget_bytes(config_memory_budget_gb: float | None, ranks_per_host: int = 1) -> int:
    """The per-rank budget on CPU: the configured GiB, else this host's memory split evenly
    among `ranks_per_host` ranks (MemTotal from /proc/meminfo, else sysconf)."""
    if config_memory_budget_gb is not None:
        if not config_memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb={config_memory_budget_gb}: must be > 0 (GiB)")
        return int(config_memory_budget_gb * _GIB)
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host={ranks_per_host}: must be >= 1")
    return _host_memory_bytes() // ranks_per_host


def _host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or an unreadable procfs: ask sysconf instead
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def gpu_budget_bytes(device_index: int) -> int:
    """Total memory of CUDA device `device_index` (call only where CUDA is available)."""
    return int(torch.cuda.get_device_properties(device_index).total_memory)
