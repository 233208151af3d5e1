"""What one rank of a job would hold, measured on its built model before any wrapping: the
`MemoryEstimate` the strategy decision is made from, and the rank's memory budget.

Activations are measured with one forward of one sample of the first micro-batch, times the
micro-batch's size, under the job's precision (autocast to bf16/fp16 saves smaller tensors),
and once more with the model's blocks checkpointed, for the figure the planner weighs
activation checkpointing by (`estimate.checkpointed_activations`). One sample, not the whole
micro-batch: the probe must not itself need the memory of the job it decides how to fit (a
full fine-tune planned at a third of its fp32 size grew its ranks by 3.7x the budget, most of
it the probe's unsharded, uncheckpointed forward). What a forward saves grows with the batch
in proportion, but for the little that is shared across samples. Both probes leave no trace
(`probe_activation_bytes`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from raymesh.train.config import TrainConfig
from raymesh.train.estimate import (
    MemoryEstimate,
    checkpointed_activations,
    cpu_budget_bytes,
    estimate,
    fsdp_blocks,
    gpu_budget_bytes,
    probe_activation_bytes,
)
from raymesh.train.rank.parallelize import autocast_dtype, set_checkpointing
from raymesh.train.task import Task, loss_only

__all__ = ["check_precision", "estimate_memory", "one_sample"]


def one_sample(batch: Any) -> tuple[Any, int]:
    """(`batch` cut to its first sample, the number of samples): every tensor in it (nested in
    lists, tuples and dicts) sliced to `[:1]` along its first dimension, when they all have the
    same first dimension; else (`batch`, 1), measured whole."""
    sizes: set[int] = set()

    def size(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            sizes.add(x.shape[0] if x.dim() else -1)
        elif isinstance(x, (list, tuple)):
            for v in x:
                size(v)
        elif isinstance(x, dict):
            for v in x.values():
                size(v)

    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return x[:1].clone()  # its own storage: the probe counts whole storages
        if isinstance(x, (list, tuple)):
            return type(x)(cut(v) for v in x)
        if isinstance(x, dict):
            return {k: cut(v) for k, v in x.items()}
        return x

    size(batch)
    if len(sizes) != 1 or (n := sizes.pop()) < 2:
        return batch, 1
    return cut(batch), n


def check_precision(precision: str, device: torch.device) -> None:
    """ValueError when `device` cannot train in `precision`, naming the fix."""
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(
            f"precision='fp16': the ranks run on {device.type.upper()} (no CUDA GPU for them: "
            "gpus=False, or none in the cluster), and fp16 needs loss scaling on GPU ranks; use "
            "precision='bf16' on CPU, or 'fp32'"
        )
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"precision='bf16': {torch.cuda.get_device_name(device)} has no bf16; use "
            "precision='fp16' (loss-scaled) or 'fp32'"
        )


def estimate_memory(
    task: Task, batch: Any, config: TrainConfig, device: torch.device, ranks_per_host: int
) -> tuple[MemoryEstimate, int]:
    """The estimate for `task`'s model (activations measured on `batch`, or the config's
    `activation_bytes`) and this rank's budget in bytes."""
    dtype = autocast_dtype(config.precision)
    activation = config.activation_bytes
    # No second probe when the user turned checkpointing off: the planner will not weigh it.
    blocks = fsdp_blocks(task.model) if config.activation_checkpointing is not False else []
    checkpointed = None
    loss = loss_only(task.loss_fn)
    if activation is None:
        one, n = one_sample(batch)
        activation = n * probe_activation_bytes(task.model, loss, one, autocast=dtype)
        if blocks:
            set_checkpointing(task.model, True)
            try:
                probed = n * probe_activation_bytes(
                    task.model, loss, one, autocast=dtype, inputs_of=blocks
                )
            finally:
                set_checkpointing(task.model, False)
            checkpointed = checkpointed_activations(activation, probed, len(blocks))
    elif blocks:  # the user's figure, spread over the blocks as the probes would see it
        checkpointed = checkpointed_activations(activation, activation // len(blocks), len(blocks))
    if device.type == "cuda":
        budget = gpu_budget_bytes(device.index or 0)
    else:
        budget = cpu_budget_bytes(config.memory_budget_gb, ranks_per_host=ranks_per_host)
    e = estimate(task.model, task.optimizer, activation)
    return dataclasses.replace(e, checkpointed_activation_bytes=checkpointed), budget
