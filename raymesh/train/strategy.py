"""DDP, FSDP2 or HSDP, chosen from a per-rank memory estimate: pure arithmetic, decisions as data.

`estimate()` adds up what one rank holds (parameters, gradients, optimizer state, activations);
`StrategyPolicy.decide()` compares it with the rank's memory budget and returns a
`StrategyDecision` whose `reason` shows the arithmetic. The controller logs the reason and
carries the decision out; nothing here touches a process group, so every rule is unit-tested
without one.

The rule (`strategy="auto"`): replicate (DDP) when everything fits in `headroom` of the budget;
else, when the ranks form shard groups (`shard_size`: one host's ranks each, or the config's),
HSDP when sharding within a group fits: FSDP2 inside each group, replicas across groups, so
only an all-reduce of 1/shard_size of the gradients crosses hosts instead of every all-gather
and reduce-scatter; else shard over every rank (FSDP2, `fully_shard` per block) when that fits;
else fail before training with the numbers and the fix. Between HSDP and FSDP the planner's
communication estimate, when given, has the last word. `"ddp"`/`"fsdp"`/`"hsdp"` force the
choice, and the reason says if it exceeds the budget; a job too big for the budget under every
strategy always fails.

The estimate is deliberately simple (no allocator fragmentation, no communication buckets, no
CUDA context); `headroom` (default 80%) is the allowance for everything it leaves out.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
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
    "host_shard_size",
    "largest_block_bytes",
    "probe_activation_bytes",
    "splits_into_shard_groups",
]


_GIB = 1 << 30
_REQUESTS = ("auto", "ddp", "fsdp", "hsdp")


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

    strategy: Literal["ddp", "fsdp", "hsdp"]
    reason: str
    estimate: MemoryEstimate
    budget_bytes: int
    shard_size: int | None = None  # HSDP: ranks per shard group (replicas: world / shard_size)

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
            f"fsdp over {_ranks(world_size)}: the world of {world_size} no longer splits into "
            f"shard groups of {self.shard_size} (was: {self.reason})"
        )
        return dataclasses.replace(self, strategy="fsdp", shard_size=None, reason=reason)


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
        self,
        requested: str,
        estimate: MemoryEstimate,
        world_size: int,
        budget_bytes: int,
        *,
        shard_size: int | None = None,
        comm: Mapping[str, float] | None = None,
    ) -> StrategyDecision:
        """The strategy for `world_size` ranks of `budget_bytes` each.

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
        if requested not in _REQUESTS:
            raise ValueError(f"strategy={requested!r}: use one of {list(_REQUESTS)}")
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes={budget_bytes}: must be > 0")
        if shard_size is not None and not splits_into_shard_groups(world_size, shard_size):
            raise ValueError(
                f"shard_size={shard_size}: HSDP needs at least 2 shard groups of at least 2 "
                f"ranks, so a divisor of the world size {world_size} between 2 and "
                f"{world_size // 2}"
            )
        if requested == "hsdp" and shard_size is None:
            raise ValueError(
                f"strategy='hsdp' over {_ranks(world_size)} has no shard groups: set "
                "shard_size (ranks per group, a divisor of workers), or run on hosts that "
                "each hold the same number (>= 2) of ranks, one group per host"
            )
        ddp, fsdp = estimate.ddp_bytes(), estimate.fsdp_bytes(world_size)
        hsdp = estimate.fsdp_bytes(shard_size) if shard_size else None
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

        def summary(strategy: str) -> str:
            if strategy == "ddp":
                return _ddp_sum(estimate, unit)
            if strategy == "hsdp":
                assert shard_size is not None
                return _fsdp_sum(estimate, shard_size, unit)
            return _fsdp_sum(estimate, world_size, unit)

        need = {"ddp": ddp, "fsdp": fsdp, "hsdp": hsdp}
        chosen: Literal["ddp", "fsdp", "hsdp"]
        if requested == "auto":
            hsdp_cheaper = comm is None or comm.get("hsdp", 0.0) <= comm.get("fsdp", math.inf)
            if ddp <= limit:
                chosen, why = "ddp", f"fits {budget}"
            elif hsdp is not None and hsdp <= limit and hsdp_cheaper:
                chosen = "hsdp"
                why = f"fits {budget}; ddp would need {_fmt(ddp, unit)}"
            elif fsdp <= limit:
                chosen, why = "fsdp", f"fits {budget}; ddp would need {_fmt(ddp, unit)}"
                if hsdp is not None and hsdp > limit:
                    why += f", hsdp over groups of {shard_size} {_fmt(hsdp, unit)}"
            else:
                hsdp_text = (
                    f", hsdp over groups of {shard_size} needs {summary('hsdp')}"
                    if hsdp is not None
                    else ""
                )
                raise ValueError(
                    f"the job does not fit {budget}: ddp needs {_ddp_sum(estimate, unit)}, "
                    f"fsdp over {_ranks(world_size)} needs {summary('fsdp')}{hsdp_text}; "
                    f"{_fixes(estimate, world_size, budget_bytes, self.headroom)}"
                )
        else:
            chosen = requested  # type: ignore[assignment]
            bytes_ = need[chosen]
            assert bytes_ is not None  # hsdp without shard groups was refused above
            if bytes_ <= limit:
                why = f"fits {budget}"
            elif bytes_ <= budget_bytes:
                why = f"exceeds {budget} (forced by strategy={requested!r})"
            else:
                why = (
                    f"exceeds the whole {_fmt(budget_bytes, bunit)} budget "
                    f"(forced by strategy={requested!r}; expect out-of-memory)"
                )
        name: str = chosen
        if chosen == "hsdp":
            assert shard_size is not None
            name = (
                f"hsdp {world_size // shard_size}x{shard_size} (sharded within groups of "
                f"{shard_size}, replicated across {world_size // shard_size})"
            )
        reason = f"{name}: {summary(chosen)} {why}"
        if comm and chosen in comm:
            others = ", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in comm.items() if k != chosen)
            reason += f"; estimated communication {comm[chosen] * 1e3:.3g} ms per step" + (
                f" (vs {others})" if others else ""
            )
        return StrategyDecision(
            strategy=chosen,
            reason=reason,
            estimate=estimate,
            budget_bytes=budget_bytes,
            shard_size=shard_size if chosen == "hsdp" else None,
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
