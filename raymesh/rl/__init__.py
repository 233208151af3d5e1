"""raymesh.rl: reinforcement learning on meshes (issue 36, in progress).

What is here: the learning rules, as pure functions of tensors (`GRPO` for language models,
`PPO` with `gae` for environments), and the bounded, versioned `RolloutBuffer` that will sit
between the generators and the trainer. The loop that runs generators, rewards and a
raymesh.train trainer as meshes (`rl.run`) is not built yet.
"""

from raymesh.rl.algorithms import (
    GRPO,
    PPO,
    Stats,
    clipped_surrogate,
    gae,
    group_advantages,
    grpo_loss,
    kl_to_reference,
    ppo_loss,
)
from raymesh.rl.buffer import Rollout, RolloutBuffer

__all__ = [
    "GRPO",
    "PPO",
    "Rollout",
    "RolloutBuffer",
    "Stats",
    "clipped_surrogate",
    "gae",
    "group_advantages",
    "grpo_loss",
    "kl_to_reference",
    "ppo_loss",
]
