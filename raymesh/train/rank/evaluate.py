"""Evaluating `Task.eval_dataset` on every rank: the report's `eval_loss`.

Rank r of w evaluates samples r, r + w, r + 2w, ... in batches, without gradients and in the
step's precision; the ranks' sums are all-reduced, so every rank returns the same mean over the
whole dataset, weighted by sample, whatever the world size. Every rank runs the same number of
forwards (a rank past its last sample runs one on its first sample and weighs it 0): under
FSDP a forward is collective (its all-gathers), and a rank that stopped early would hang the
others. A DDP model is evaluated through its inner module: DDP's forward may broadcast buffers,
a collective the ranks are not all in step for here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from raymesh.train.rank.step import Precision, to_device

__all__ = ["due", "evaluate"]


def due(done: int, steps: int, every: int | None) -> bool:
    """Whether to evaluate once `done` of `steps` steps are complete: every `every` steps
    (`TrainConfig.eval_every`), and at the last step (with `every` None, only there)."""
    return done == steps or bool(every and done % every == 0)


def evaluate(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    read: Callable[[list[int]], Any],
    n: int,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    device: torch.device,
    precision: Precision,
) -> float:
    """The mean of `loss_fn` over the `n` samples `read` loads by index (a batch of the eval
    dataset; see the module docstring). COLLECTIVE when
    `world_size` > 1: every rank of the group calls it at the same step. Leaves the model in
    the training mode it found it in."""
    if n == 0:
        raise ValueError("Task.eval_dataset is empty: give it samples, or None for no evaluation")
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    mine = list(range(rank, n, world_size))
    batches = math.ceil(math.ceil(n / world_size) / batch_size)
    total = torch.zeros(2, dtype=torch.float64)
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for b in range(batches):
                indices = mine[b * batch_size : (b + 1) * batch_size]
                weight = len(indices)
                with precision.forward(device):
                    loss = loss_fn(module, to_device(read(indices or [rank % n]), device))
                total += torch.tensor([float(loss) * weight, weight], dtype=torch.float64)
    finally:
        module.train(training)
    if world_size > 1 and dist.is_initialized():
        backend = dist.get_backend()
        if backend == "nccl":  # NCCL reduces device tensors only
            total = total.to(device)
        dist.all_reduce(total)
    return float(total[0] / total[1])
