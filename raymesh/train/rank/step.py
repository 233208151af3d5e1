"""One training step on one rank, and the timing load balancing reads from it.

`run_step` runs the forward and backward of each micro batch (reducing gradients only on the
last, `parallelize.no_sync`; under autocast when the step's `Precision` says), then clips the
gradients, sets the step's learning rate (`lr_factor`) and steps the optimizer, marking each
phase for the Monitor.
`Timing` keeps the rank's own compute time per step, without the time spent waiting for its
peers in the gradient reduction: that is what `raymesh.train.control.balance` compares across ranks.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from raymesh.train.hooks import RankHooks
from raymesh.train.rank.monitor import mark
from raymesh.train.rank.parallelize import no_sync
from raymesh.train.sections import StepConfig
from raymesh.train.task import LossFn

__all__ = ["Precision", "Share", "Timing", "lr_factor", "mix", "run_step", "seed_step", "to_device"]


def lr_factor(schedule: str, warmup_steps: int, step: int, steps: int) -> float:
    """What the optimizer's learning rate is multiplied by at 0-based `step` of `steps`: a
    linear warmup from 1/warmup_steps to 1 over the first `warmup_steps`, then 1 ("constant")
    or decaying to 0 at `steps` ("linear", "cosine"). A pure function of the step, so a healed
    or resumed run uses the same rate as an uninterrupted one."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, steps - warmup_steps)
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


@dataclass
class Precision:
    """How a step computes: `autocast` (the dtype under DDP or one rank; None under FSDP2,
    whose mixed-precision policy casts instead, or in fp32) and the fp16 loss `scaler`."""

    autocast: torch.dtype | None = None
    scaler: Any = None  # torch.amp.GradScaler, fp16 only

    def forward(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)


def mix(*values: int) -> int:
    """A stable 63-bit seed from integers (Python's hash() is salted per process)."""
    acc = 0x9E3779B97F4A7C15
    for v in values:
        acc = (acc ^ (v + 0x9E3779B97F4A7C15 + (acc << 6) + (acc >> 2))) & (2**64 - 1)
    return acc & (2**63 - 1)


def seed_step(seed: int, device: torch.device) -> None:
    """Seed the random generators a step draws from: the CPU's, and `device`'s when it is a
    GPU. (`torch.manual_seed` seeds every device type torch knows, ~0.14 ms: a third of a small
    model's step.)"""
    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)  # the current device's generator


def to_device(batch: Any, device: torch.device) -> Any:
    """`batch` (tensors, possibly nested in lists, tuples and dicts) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


@dataclass
class Timing:
    """A rank's own forward + backward time in its last step, and the samples it covered."""

    ddp_timings: bool = False  # DDP's runtime logging is on (see `ddp_compute_s`)
    compute_s: float = 0.0
    samples: int = 0
    step_samples: int = 0  # samples of the last step (DDP's figure is one step late)
    base_s: float = 0.0  # compute_s without the time spent in hooks: what a hook is given
    hook_s: float = 0.0  # time spent in hooks in the last step

    def account(
        self,
        model: torch.nn.Module,
        samples: int,
        single: bool,
        wall: float,
        quiet: tuple[float, int],
        hook_s: float,
    ) -> None:
        """Record a step: `samples` trained in one micro batch (`single`) or several, `wall`
        seconds of forward + backward, `quiet` (seconds, samples) of the micro batches that
        did not reduce, `hook_s` of it spent in hooks."""
        measured = self.ddp_compute_s(model) if single else None
        if quiet[1]:  # gradient accumulation: the quiet micro batches measure the rank alone
            self.compute_s, self.samples = quiet
        elif measured is not None:  # DDP's figures are the previous step's: pair them so
            self.compute_s, self.samples = measured, self.step_samples
        else:  # wall times include waiting, except on the slowest rank
            self.compute_s, self.samples = wall, samples
        self.step_samples = samples
        # The rank's own compute: DDP's figure when there is one (the previous step's, with the
        # previous hook time in it); else the wall time, which is the compute while this rank
        # is the slowest (the last to reach the reduction).
        base = measured - self.hook_s if measured is not None else wall - hook_s
        self.base_s, self.hook_s = max(base, 0.0), hook_s

    def ddp_compute_s(self, model: torch.nn.Module) -> float | None:
        """The forward + backward compute DDP measured on this rank, without the time spent
        waiting for peers in the all-reduce (its runtime logging, on when rebalancing). DDP
        logs a step when the next one starts, so this is the previous step's; None when
        there is no such figure (logging off, not DDP, the first step)."""
        if not self.ddp_timings or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return None
        try:
            stats = model._get_ddp_logging_data()
            seconds = (stats["forward_compute_time"] + stats["backward_compute_time"]) / 1e9
        except (AttributeError, KeyError, RuntimeError):  # a torch without these stats
            return None
        return seconds if seconds > 0 else None


@dataclass(frozen=True, kw_only=True)
class Share:
    """A rank's share of one step: its micro batches (sample indices; `load` makes one a batch
    on the device), and where the rank stands among the ranks, which weighs its loss."""

    step: int  # 0-based
    rank: int
    world_size: int
    global_batch_size: int
    micro: Sequence[Sequence[int]]
    load: Callable[[Sequence[int]], Any]


def run_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: LossFn,
    share: Share,
    *,
    config: StepConfig,
    steps: int,
    device: torch.device,
    precision: Precision,
    timing: Timing,
    hooks: RankHooks | None,
) -> tuple[float, dict[str, float]]:
    """Train `share` of its step as `config` says (gradient clipping, the learning-rate
    schedule over the run's `steps`; `precision` is its autocast and loss scaler); return
    this rank's loss, summed over its micro batches, and the statistics `loss_fn` returned
    with it (when it returns `(loss, {name: value})`), weighed as the loss is, so that the
    mean over the ranks is the global batch's."""
    step, rank, micro, load = share.step, share.rank, share.micro, share.load
    stats: dict[str, float] = {}
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=device)
    wall = 0.0  # forward + backward wall time
    quiet, quiet_samples = 0.0, 0  # of which micro batches that do not reduce (no waiting)
    hook_s = 0.0  # of which time in hooks
    for i, m in enumerate(micro):
        last = i == len(micro) - 1
        with no_sync(model, not last):
            mark(step + 1, "forward")
            # The loss is a mean over the micro batch; weighting it by the micro batch's share
            # of the global batch (x world size, as the reduction averages ranks) makes the
            # averaged gradient the global batch's mean for any split.
            weight = len(m) * share.world_size / share.global_batch_size
            t0 = time.perf_counter()
            with precision.forward(device):
                loss = _weighed(loss_fn(model, load(m)), weight, stats)
            if hooks is not None and last:
                t_hook = time.perf_counter()
                hooks.in_step(rank, step + 1, timing.base_s)
                hook_s = time.perf_counter() - t_hook
            mark(step + 1, "backward")
            (precision.scaler.scale(loss) if precision.scaler is not None else loss).backward()
            seconds = time.perf_counter() - t0
            wall += seconds
            if not last:  # only the last micro batch reduces, so only it waits for peers
                quiet, quiet_samples = quiet + seconds, quiet_samples + len(m)
        total += loss.detach()
    samples = sum(len(m) for m in micro)
    timing.account(model, samples, len(micro) == 1, wall, (quiet, quiet_samples), hook_s)
    mark(step + 1, "optimizer")
    if precision.scaler is not None:
        precision.scaler.unscale_(optimizer)  # clip the true gradients
    if config.grad_clip is not None:
        grads = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(grads, config.grad_clip)
    lr = lr_factor(config.lr_schedule, config.warmup_steps, step, steps)
    if lr != 1.0 or any("initial_lr" in g for g in optimizer.param_groups):
        for g in optimizer.param_groups:
            g["lr"] = g.setdefault("initial_lr", g["lr"]) * lr
    if precision.scaler is not None:
        precision.scaler.step(optimizer)
        precision.scaler.update()
    else:
        optimizer.step()
    return float(total), stats


def _weighed(out: Any, weight: float, stats: dict[str, float]) -> torch.Tensor:
    """The loss of `out` (what a `loss_fn` returned: the loss, or (loss, statistics)) times
    `weight`; the statistics, times `weight`, added to `stats`."""
    if isinstance(out, tuple):
        loss, extra = out
        for k, v in extra.items():
            stats[k] = stats.get(k, 0.0) + float(v) * weight
    else:
        loss = out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:  # what backward() takes
        got = type(loss).__name__ if not isinstance(loss, torch.Tensor) else list(loss.shape)
        raise TypeError(
            f"loss_fn returned {got}: return the batch's mean loss as a one-number tensor, or "
            "(loss, {name: float}) with statistics to report beside it"
        )
    return loss * weight
