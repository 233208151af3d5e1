"""An RL run's config (`rl.RLConfig`): what `rl.run` runs, checked on construction, in sections
as `train.TrainConfig` is. A user writes its flat fields (`rl.run`'s keyword arguments, or a
job file's keys: `load_rl_job`); each section, built from those fields, checks its own:

- `TaskConfig`: what is learned and how it is scored: the algorithm, the policy (its build
  function and where it starts), the prompts and the reward (GRPO), or none of them (PPO,
  whose environment is the algorithm's);
- `RolloutConfig`: what makes the samples and how far behind: generators or environment
  runners, prompts a step, staleness, the timeouts;
- `SaveConfig`: the checkpoint folder, how often, resuming, the run folder.

RLConfig checks what spans them (the steps, the seed, the learner's `trainer`). A bad field is
a ValueError naming it, its value and the fix, before any proc starts. What needs an import or
a live mesh (a "module:function" that imports nothing, a reward mesh without `score`, an
unknown gymnasium environment) is checked by `roles`, also before any proc starts. Frozen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from raymesh._common import bad, brief, check_int, check_seconds, store_sections, stored
from raymesh.actor import ActorMesh
from raymesh.rl.algorithms import GRPO, PPO
from raymesh.train import TrainConfig

__all__ = ["RLConfig", "RolloutConfig", "SaveConfig", "TaskConfig"]


def _function(name: str, value: Any, what: str) -> None:
    """A callable, or a "module:function" name (imported by `roles`)."""
    if callable(value) or (isinstance(value, str) and ":" in value):
        return
    raise bad(name, value, f"name a function as 'module:function', or give {what}")


@dataclass(frozen=True, kw_only=True)
class TaskConfig:
    """What is learned: GRPO post-trains `policy` (a train build function) on `prompts`
    scored by `reward`, from the checkpoint `init` or with `params`; PPO trains `policy`
    (None: `rl.ActorCritic`) on its algorithm's environment, and takes none of the rest."""

    algorithm: GRPO | PPO
    policy: str | Callable[..., Any] | None
    prompts: Sequence[str | bytes] | None
    reward: Any
    init: str | None
    params: dict[str, Any] | None

    def __post_init__(self) -> None:
        if isinstance(self.algorithm, PPO):
            for name in ("prompts", "reward", "init", "params"):
                if getattr(self, name) is not None:
                    value = brief(getattr(self, name))
                    raise bad(name, value, "environment RL (rl.PPO) takes none: leave it out")
            if self.policy is not None:
                _function("policy", self.policy, "a build function, or leave it out")
            return
        if not isinstance(self.algorithm, GRPO):
            raise bad("algorithm", self.algorithm, "give rl.GRPO(...) or rl.PPO(env=...)")
        if self.policy is None:
            raise bad(
                "policy", None, 'give a train build function, e.g. "raymesh.examples.tinygpt:build"'
            )
        _function("policy", self.policy, "a build function")
        prompts = self.prompts
        if (
            isinstance(prompts, (str, bytes))
            or not isinstance(prompts, Sequence)
            or not prompts
            or not all(isinstance(p, (str, bytes)) for p in prompts)
        ):
            raise bad("prompts", brief(prompts), "give a non-empty list of strings")
        object.__setattr__(self, "prompts", tuple(prompts))  # frozen, as the rest
        if self.reward is None:
            raise bad("reward", None, "give a function (prompt, completion) -> float")
        if not isinstance(self.reward, ActorMesh):
            _function("reward", self.reward, "a function (prompt, completion) -> float or a mesh")
        if self.params is not None and not isinstance(self.params, dict):
            raise bad("params", self.params, "give a dict: the build function's ctx.params")
        if self.params is not None and self.init is not None:
            fix = "init's checkpoint brings its job's params: leave it out"
            raise bad("params", self.params, fix)
        if self.init is not None and not isinstance(self.init, str):
            raise bad("init", self.init, "give the folder of a raymesh.train checkpoint")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """What makes the samples: GRPO's `generators` procs answer `prompts_per_step` prompts a
    step in groups; PPO's `env_runners` procs step the environment. A step's samples come
    from a policy at most `max_staleness` versions behind the learner's. `timeout_s`: the
    longest wait for a step's samples (or a learner call); `reward_timeout_s`: for one reward
    actor's score."""

    prompts_per_step: int
    generators: int
    env_runners: int
    max_staleness: int
    timeout_s: float
    reward_timeout_s: float

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "generators", "env_runners"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("max_staleness", self.max_staleness, minimum=0)
        check_seconds("timeout_s", self.timeout_s)
        check_seconds("reward_timeout_s", self.reward_timeout_s)


@dataclass(frozen=True, kw_only=True)
class SaveConfig:
    """`checkpoint`: the folder the run saves the policy in at its end, and every
    `checkpoint_every` steps (0: only at the end); `resume`: continue from its newest
    checkpoint; `run_dir`: the run folder (None: the checkpoint folder, as a train job's)."""

    checkpoint: str | None
    checkpoint_every: int
    resume: bool
    run_dir: str | None

    def __post_init__(self) -> None:
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        if not isinstance(self.resume, bool):
            raise bad("resume", self.resume, "use True or False")
        for name in ("checkpoint", "run_dir"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise bad(name, value, "give a folder's path as a string")
        if self.checkpoint is None and (self.resume or self.checkpoint_every):
            fix = "give checkpoint= the folder the run saves in and resumes from"
            if self.resume:
                raise bad("resume", self.resume, fix)
            raise bad("checkpoint_every", self.checkpoint_every, fix)


# RLConfig's sections by property name.
_SECTIONS: dict[str, type] = {"task": TaskConfig, "rollout": RolloutConfig, "save": SaveConfig}


@dataclass(frozen=True, kw_only=True)
class RLConfig:
    """An RL run (see the module docstring and `rl.run`): at most `steps` policy updates of
    `algorithm` (GRPO by default), seeded with `seed`, the learner a train job of `trainer`
    (a dict of `train.TrainConfig` fields, or one; None: one rank)."""

    steps: int
    algorithm: GRPO | PPO = field(default_factory=GRPO)
    seed: int = 0
    # the task
    policy: str | Callable[..., Any] | None = None
    prompts: Sequence[str | bytes] | None = None
    reward: Any = None  # a function, its "module:function" name, or a mesh of reward actors
    init: str | None = None
    params: dict[str, Any] | None = None
    # the rollouts
    prompts_per_step: int = 4
    generators: int = 2
    env_runners: int = 2
    max_staleness: int = 0
    timeout_s: float = 300.0
    reward_timeout_s: float = 60.0
    # what is saved
    checkpoint: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    run_dir: str | None = None
    # the learner's train job
    trainer: TrainConfig | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        check_int("steps", self.steps, minimum=1)
        check_int("seed", self.seed)
        if self.trainer is not None and not isinstance(self.trainer, (TrainConfig, dict)):
            raise bad("trainer", self.trainer, "give a dict of train.TrainConfig fields, or one")
        store_sections(self, _SECTIONS)  # each checks its own fields, once

    @property
    def task(self) -> TaskConfig:
        return stored(self, "task", TaskConfig)

    @property
    def rollout(self) -> RolloutConfig:
        return stored(self, "rollout", RolloutConfig)

    @property
    def save(self) -> SaveConfig:
        return stored(self, "save", SaveConfig)
