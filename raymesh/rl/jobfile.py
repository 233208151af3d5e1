"""An RL job from a TOML file (`raymesh rl job.toml`): a file of its own, whose top level is
`rl.run`'s arguments and whose `[grpo]` or `[ppo]` table is the algorithm's. GRPO:

    policy = "raymesh.examples.tinygpt:build"     # the trained model's build function
    init = "runs/tinygpt"                          # start from its checkpoint
    reward = "raymesh.examples.rewards:python_lines"
    prompts = ["def ", "import ", "class "]        # or prompts_file = "prompts.txt" (a line each)
    steps = 20
    checkpoint = "runs/tinygpt-grpo"               # the post-trained policy, served as any run
    checkpoint_every = 10                          # and every 10 steps (`raymesh rl --resume`)
    [grpo]
    group_size = 8
    max_tokens = 32
    [trainer]                                      # the learner's train job (default: 1 rank)
    workers = 2
    strategy = "fsdp"

PPO on a gymnasium environment (no policy, reward, prompts or init; `policy` optional):

    steps = 300
    env_runners = 2
    checkpoint = "runs/cartpole"
    [ppo]
    env = "CartPole-v1"
    lr = 1e-3
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raymesh._common import bad, check_int, check_seconds, from_table, read_toml
from raymesh.rl.algorithms import GRPO, PPO

__all__ = ["RLJob", "load_rl_job"]


@dataclass(frozen=True, kw_only=True)
class RLJob:
    """`rl.run`'s arguments, from a job file (see the module); checked on construction."""

    steps: int
    policy: str | None = None  # GRPO: required; PPO: None is rl.ActorCritic
    reward: str | None = None  # GRPO only
    prompts: list[str] = field(default_factory=list)
    prompts_file: str | None = None
    init: str | None = None
    params: dict[str, Any] | None = None  # [params]: the build function's ctx.params
    checkpoint: str | None = None
    checkpoint_every: int = 0  # also save every this many steps (0: only at the end)
    resume: bool = False  # continue from the newest checkpoint (`raymesh rl --resume`)
    run_dir: str | None = None  # metrics.jsonl: a JSON line per step
    prompts_per_step: int = 4
    generators: int = 2
    max_staleness: int = 0
    seed: int = 0
    timeout_s: float = 300.0
    env_runners: int = 2  # PPO's runner procs
    grpo: GRPO | None = None  # [grpo]; neither table: GRPO's defaults
    ppo: PPO | None = None  # [ppo]: its env at least
    trainer: dict[str, Any] | None = None  # [trainer]: the learner job's TrainConfig fields

    def __post_init__(self) -> None:
        if self.ppo is not None:
            self._check_ppo()
            return
        if self.grpo is None:
            object.__setattr__(self, "grpo", GRPO())
        for key in ("policy", "reward"):
            value = getattr(self, key)
            if not isinstance(value, str) or ":" not in value:
                raise bad(key, value, "name a function as 'module:function'")
        for key in ("steps", "prompts_per_step", "generators"):
            check_int(key, getattr(self, key), minimum=1)
        self._check_common()
        if self.prompts and self.prompts_file is not None:
            raise bad("prompts_file", self.prompts_file, "give prompts or prompts_file, not both")
        if self.prompts_file is not None:
            path = Path(self.prompts_file)
            if not path.is_file():
                raise bad("prompts_file", self.prompts_file, "no such file: a prompt per line")
            lines = [line for line in path.read_text("utf-8").splitlines() if line.strip()]
            object.__setattr__(self, "prompts", lines)
        if not self.prompts or not all(isinstance(p, str) for p in self.prompts):
            raise bad("prompts", self.prompts, "give a non-empty list of strings")

    def _check_ppo(self) -> None:
        if self.grpo is not None:
            raise bad("ppo", self.ppo, "give [grpo] or [ppo], not both")
        for key in ("reward", "init", "params", "prompts_file"):
            if getattr(self, key) is not None:
                raise bad(key, getattr(self, key), "a [ppo] job takes none: leave it out")
        if self.prompts:
            raise bad("prompts", self.prompts, "a [ppo] job takes none: leave it out")
        if self.policy is not None and (not isinstance(self.policy, str) or ":" not in self.policy):
            raise bad(
                "policy", self.policy, "name a function as 'module:function', or leave it out"
            )
        check_int("steps", self.steps, minimum=1)
        check_int("env_runners", self.env_runners, minimum=1)
        self._check_common()

    def _check_common(self) -> None:
        check_int("max_staleness", self.max_staleness, minimum=0)
        check_int("checkpoint_every", self.checkpoint_every, minimum=0)
        if not isinstance(self.resume, bool):
            raise bad("resume", self.resume, "use true or false")
        check_int("seed", self.seed)
        check_seconds("timeout_s", self.timeout_s)
        if self.trainer is not None and not isinstance(self.trainer, dict):
            raise bad("trainer", self.trainer, "give a [trainer] table of TrainConfig fields")

    def run_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `rl.run`."""
        common = {
            "policy": self.policy,
            "steps": self.steps,
            "max_staleness": self.max_staleness,
            "seed": self.seed,
            "checkpoint": self.checkpoint,
            "checkpoint_every": self.checkpoint_every,
            "resume": self.resume,
            "run_dir": self.run_dir,
            "timeout_s": self.timeout_s,
            "trainer": self.trainer,
        }
        if self.ppo is not None:
            return {**common, "algorithm": self.ppo, "env_runners": self.env_runners}
        return {
            **common,
            "prompts": self.prompts,
            "reward": self.reward,
            "algorithm": self.grpo,
            "prompts_per_step": self.prompts_per_step,
            "generators": self.generators,
            "init": self.init,
            "params": self.params,
        }


def load_rl_job(path: str | Path, **overrides: Any) -> RLJob:
    """The RLJob of the file `path`, with `overrides` (None values skipped) on top. ValueError
    naming the file and the field."""
    data = read_toml(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        for name, cls in (("grpo", GRPO), ("ppo", PPO)):
            if name in data:
                data[name] = from_table(cls, data[name], name)
        return from_table(RLJob, data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
