"""What `rl.run` returns (`RLResult`): the steps' statistics, the final policy and how the run
got there (the keys made again, the workers and learner ranks replaced, the checkpoint)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from raymesh.rl.algorithms import Stats
from raymesh.train import FailureRecord

__all__ = ["RLResult"]


@dataclass
class RLResult:
    """What `run` did: one statistics row per step (`history`), the final policy version and
    its weights (`state_dict()`), the keys made again after a generator was lost or a rollout
    went stale, and how many generators were replaced."""

    history: list[Stats]
    version: int
    weights: dict[str, torch.Tensor]
    remade: list[int] = field(default_factory=list)
    replaced: int = 0
    checkpoint: str | None = None  # the step folder the final policy was saved in
    # the learner ranks lost and replaced (GRPO's learner job's `Result.failures`)
    learner_failures: list[FailureRecord] = field(default_factory=list)
    resumed_from: int = 0  # the version the run continued from (0: a fresh start)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.weights
