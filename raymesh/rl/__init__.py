"""raymesh.rl: reinforcement learning on meshes (issue 36, in progress).

What is here:
- the learning rules, as pure functions of tensors: `GRPO` for language models, `PPO` with
  `gae` for environments;
- the bounded, versioned `RolloutBuffer` between the generators and the trainer;
- the generator role, `Generator`: an actor holding a copy of a byte-level policy, which answers
  prompts in groups, reproducibly (a completion is a function of seed, policy version, key and
  index: `sample_seed`), and scores them with the user's reward where they are made, dropping a
  completion whose reward raises or is no finite number, with its reason.

Not built yet: the loop that runs generators, rewards and a raymesh.train trainer together
(`rl.run`), weight publication, PPO's environment runners, and `raymesh rl`.
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
from raymesh.rl.generator import Generator
from raymesh.rl.sampling import Completions, sample_seed, score

__all__ = [
    "GRPO",
    "PPO",
    "Completions",
    "Generator",
    "Rollout",
    "RolloutBuffer",
    "Stats",
    "clipped_surrogate",
    "gae",
    "group_advantages",
    "grpo_loss",
    "kl_to_reference",
    "ppo_loss",
    "sample_seed",
    "score",
]
