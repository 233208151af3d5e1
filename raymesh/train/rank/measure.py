"""What one rank of a job would hold, measured on its built model before any wrapping: the
`MemoryEstimate` the strategy decision is made from, and the rank's memory budget.

Activations are measured with one forward of the first micro-batch under the job's precision
(autocast to bf16/fp16 saves smaller tensors), and once more with the model's blocks
checkpointed, for the figure the planner weighs activation checkpointing by
(`estimate.checkpointed_activations`). Both probes leave no trace (`probe_activation_bytes`).
"""

from __future__ import annotations

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
from raymesh.train.task import Task

__all__ = ["check_precision", "estimate_memory"]


def check_precision(precision: str, device: torch.device) -> None:
    """ValueError when `device` cannot train in `precision`, naming the fix."""
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(
            f"precision='fp16': the ranks run on {device.type}, and fp16 needs loss scaling on "
            "GPU ranks; use precision='bf16' on CPU"
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
    if activation is None:
        activation = probe_activation_bytes(task.model, task.loss_fn, batch, autocast=dtype)
        if blocks:
            set_checkpointing(task.model, True)
            try:
                probed = probe_activation_bytes(
                    task.model, task.loss_fn, batch, autocast=dtype, inputs_of=blocks
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
    return MemoryEstimate(**{**e.__dict__, "checkpointed_activation_bytes": checkpointed}), budget
