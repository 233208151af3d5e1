"""An RL job from a TOML file (`raymesh rl job.toml`): an `RLConfig`, in a file of its own,
whose top level is its fields and whose `[grpo]` or `[ppo]` table is the algorithm. GRPO:

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

import dataclasses
from pathlib import Path
from typing import Any

from raymesh._common import bad, from_table, read_toml
from raymesh.rl.algorithms import GRPO, PPO
from raymesh.rl.config import RLConfig

__all__ = ["load_rl_job"]


def load_rl_job(path: str | Path, **overrides: Any) -> RLConfig:
    """The RLConfig of the job file `path` (see the module), with `overrides` (None values
    skipped) on top: its top-level keys are RLConfig's fields, its `[grpo]` or `[ppo]` table
    the algorithm, `[trainer]` and `[params]` tables those fields; `prompts_file` a file of a
    prompt per line, instead of `prompts`. ValueError naming the file and the field."""
    data = read_toml(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        if "algorithm" in data:
            raise bad("algorithm", data["algorithm"], "give a [grpo] or a [ppo] table")
        keys = {f.name for f in dataclasses.fields(RLConfig)} - {"algorithm"}
        keys |= {"grpo", "ppo", "prompts_file"}
        if unknown := sorted(set(data) - keys):
            raise ValueError(f"unknown key(s) {unknown}; the keys are {sorted(keys)}")
        tables = {name: cls for name, cls in (("grpo", GRPO), ("ppo", PPO)) if name in data}
        if len(tables) == 2:
            raise bad("ppo", data["ppo"], "give [grpo] or [ppo], not both")
        for name, cls in tables.items():
            data["algorithm"] = from_table(cls, data.pop(name), name)
        if "prompts_file" in data and "ppo" in tables:  # refused unread
            raise bad("prompts_file", data["prompts_file"], "a [ppo] job takes none: leave it out")
        if "prompts_file" in data:
            data["prompts"] = _prompts(data.pop("prompts_file"), given="prompts" in data)
        return from_table(RLConfig, data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def _prompts(file: Any, *, given: bool) -> list[str]:
    """The non-blank lines of `file` (`prompts_file`)."""
    if given:
        raise bad("prompts_file", file, "give prompts or prompts_file, not both")
    if not isinstance(file, str) or not Path(file).is_file():
        raise bad("prompts_file", file, "no such file: a prompt per line")
    return [line for line in Path(file).read_text("utf-8").splitlines() if line.strip()]
