"""What each algorithm's run spawns (`Roles`): GRPO's generators answering prompts
(`text_roles`), PPO's environment runners (`env_roles`), and the learner of each, from the
run's checked `RLConfig` sections. Each checks what those cannot before any proc starts (a
name that imports nothing, a reward mesh without `score`, an unknown environment):
ValueError naming the field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from raymesh._common import bad, resolve
from raymesh.actor import ActorMesh
from raymesh.rl.algorithms import GRPO, PPO
from raymesh.rl.config import RolloutConfig, TaskConfig
from raymesh.rl.environments import EnvRunner, spaces
from raymesh.rl.generator import Generator
from raymesh.rl.learner import GRPOTask, PPOTask
from raymesh.rl.sampling import check_scored, reward_name

__all__ = ["Roles", "check_context", "env_roles", "text_roles"]

_Spawn = tuple[type, tuple[Any, ...], dict[str, Any]]


@dataclass
class Roles:
    """What an algorithm's run spawns: the learner (the build function of the train job the
    loop drives), a worker's for
    its index and incarnation, how many workers, the rollouts a step takes, and the argument
    of a worker's `sample` call for a list of keys; `check(batch, step)`, when given, raises
    when a step's batch must not be learned from (GRPO: no completion in it was scored)."""

    name: str
    title: str  # the workers' role, as the run folder names it ("generators", "env runners")
    learner: GRPOTask | PPOTask
    worker: Callable[[int, int], _Spawn]
    workers: int
    per_step: int
    request: Callable[[list[int]], Any]
    check: Callable[[list[Any], int], None] | None = None
    # GRPO: the prompts and the tokens a completion may take, which must fit the policy's
    # context (`check_context`, once a generator can say how many tokens each prompt is)
    prompts: tuple[bytes, ...] = ()
    max_tokens: int = 0


def text_roles(task: TaskConfig, rollout: RolloutConfig, *, seed: int) -> Roles:
    """GRPO's roles for `task` (checked as plain data by its section; here what needs an
    import or a live mesh: the policy's and the reward's names, the reward mesh's `score`)."""
    assert isinstance(task.algorithm, GRPO) and task.policy is not None  # (TaskConfig's checks)
    algorithm, policy, reward = task.algorithm, task.policy, task.reward
    init, params = task.init, task.params
    items = [p.encode() if isinstance(p, str) else p for p in task.prompts or ()]
    resolve(policy, "policy")  # a name that imports nothing fails here, not in every proc
    if isinstance(reward, ActorMesh):
        try:
            reward.score  # noqa: B018 (the check: AttributeError naming the endpoints it has)
        except AttributeError as e:
            raise bad("reward", reward, f"give actors with a score endpoint ({e})") from None
    else:
        resolve(reward, "reward")

    def request(keys: list[int]) -> list[tuple[int, bytes]]:
        # key k answers prompt k mod len(prompts)
        return [(k, items[k % len(items)]) for k in keys]

    return Roles(
        name="gen",
        title="generators",
        learner=GRPOTask(policy, algorithm, init=init, params=params),
        worker=lambda i, n: (
            Generator,
            (policy, reward, algorithm),
            {
                "seed": seed,
                "init": init,
                "params": params,
                "reward_timeout_s": rollout.reward_timeout_s,
            },
        ),
        workers=rollout.generators,
        per_step=rollout.prompts_per_step,
        request=request,
        check=functools.partial(check_scored, reward=reward_name(reward)),
        prompts=tuple(items),
        max_tokens=algorithm.max_tokens,
    )


def check_context(
    prompts: Sequence[bytes], lengths: Sequence[int], context: int | None, max_tokens: int
) -> None:
    """ValueError naming the first prompt whose tokens and `max_tokens` exceed the policy's
    `context` (the learner reads the prompt and the completion in one window), with the fix."""
    if context is None:
        return
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        if n + max_tokens - 1 > context:
            fits = context - n + 1
            fix = f"lower grpo.max_tokens to {fits}" if fits >= 1 else "shorten it"
            raise bad(
                f"prompts[{i}]",
                prompt[:40],
                f"its {n} tokens and max_tokens={max_tokens} exceed the policy's context of "
                f"{context} tokens; {fix}",
            )


def env_roles(task: TaskConfig, *, runners: int, seed: int) -> Roles:
    """PPO's roles for `task` (see `text_roles`; here: the environment and the policy's name)."""
    assert isinstance(task.algorithm, PPO)
    algorithm, policy = task.algorithm, task.policy
    spaces(algorithm.env)  # an unknown environment fails here, not in every proc
    if policy is not None:
        resolve(policy, "policy")
    return Roles(
        name="runner",
        title="env runners",
        learner=PPOTask(policy, algorithm),
        worker=lambda i, n: (
            EnvRunner,
            (policy, algorithm),
            {"seed": seed, "index": i, "incarnation": n},
        ),
        workers=runners,
        per_step=runners,
        request=lambda keys: keys,
    )
