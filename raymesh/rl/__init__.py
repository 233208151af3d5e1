"""raymesh.rl: reinforcement learning on meshes (issue 36, in progress).

    from raymesh import rl

    result = rl.run(
        policy="raymesh.examples.tinygpt:build",  # a train build function: model + optimizer
        prompts=["def ", "import "],
        reward=score,                             # (prompt, completion) -> float, or "module:fn"
        algorithm=rl.GRPO(group_size=8, max_tokens=32),
        steps=100,
        generators=2,                             # generator procs
        max_staleness=1,                          # 0: synchronous
        trainer={"workers": 2, "strategy": "fsdp"},  # the learner: a train job
    )

What is here:
- `RLConfig`: `run`'s keyword arguments as one config in sections, checked on construction;
  a job file is one (`load_rl_job`);
- `run`: GRPO post-training of a byte-level policy with a mesh of `Generator` procs and a
  learner that is a raymesh.train job the loop drives (`trainer=`: its ranks, strategy,
  precision; a lost rank heals under the loop), on one controller, asynchronous up to
  `max_staleness` versions; a generator SIGKILLed mid-rollout is replaced and its rollouts made
  again, so a synchronous run ends with the weights of a run without the fault (docs/rl.md).
- `run(algorithm=PPO(env=...))`: PPO on a gymnasium environment, with a mesh of `EnvRunner`
  procs (GAE computed where the values are) and a learner train job (`PPOTask`); a runner SIGKILLed
  mid-segment is replaced and its segment made again (docs/rl.md);
- the learning rules, as pure functions of tensors: `GRPO` for language models, `PPO` with
  `gae` for environments;
- the bounded, versioned `RolloutBuffer` between the generators and the learner;
- reproducible sampling (`sample_seed`: a completion is a function of seed, policy version, key
  and index) and scoring (`score`: a reward that raises or is no finite number drops only its
  completion, with its reason; a step with no completion scored ends the run: `RewardError`).

Also: reward actors (`reward=` a mesh), `checkpoint=` and `resume`, the run folder the
dashboard shows (docs/rl.md). Not built yet: one RL config and one run folder with train's,
weight sync over Ray's tensor transport.
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
from raymesh.rl.api import run
from raymesh.rl.buffer import Rollout, RolloutBuffer
from raymesh.rl.config import RLConfig
from raymesh.rl.environments import ActorCritic, EnvRunner, Segment
from raymesh.rl.generator import Generator
from raymesh.rl.jobfile import load_rl_job
from raymesh.rl.learner import GRPOTask, PPOTask, completion_samples
from raymesh.rl.result import RLResult
from raymesh.rl.sampling import Completions, RewardError, sample_seed, score

__all__ = [
    "GRPO",
    "PPO",
    "ActorCritic",
    "Completions",
    "EnvRunner",
    "GRPOTask",
    "Generator",
    "PPOTask",
    "RLConfig",
    "RLResult",
    "RewardError",
    "Rollout",
    "RolloutBuffer",
    "Segment",
    "Stats",
    "clipped_surrogate",
    "completion_samples",
    "gae",
    "group_advantages",
    "grpo_loss",
    "kl_to_reference",
    "load_rl_job",
    "ppo_loss",
    "run",
    "sample_seed",
    "score",
]
