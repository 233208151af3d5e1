"""The generator role: an actor holding a copy of the policy, which answers prompts in groups
and scores the answers where they are made.

A mesh of these is the RL loop's sampler: `load(version, state)` installs policy `version`
(the weights the trainer published), `sample(items)` answers each (key, prompt) with
`group_size` completions under the installed version, scored by the reward, as `Rollout`s
for the buffer. Completions are reproducible (`raymesh.rl.sampling`), so a rollout lost with
its generator is remade elsewhere, the same.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from raymesh._common import resolve
from raymesh.actor import ActorMesh, endpoint
from raymesh.rl.algorithms import GRPO
from raymesh.rl.buffer import Rollout
from raymesh.rl.policy_copy import PolicyCopy
from raymesh.rl.sampling import Completions, Reward, sample_group, sample_seed, score
from raymesh.train.export import rebuild

__all__ = ["Generator"]

logger = logging.getLogger("raymesh")


class Generator(PolicyCopy):
    """One generator proc. `policy` is a raymesh.train build function (or its
    "module:function" name) of a byte-level model (`vocab` 256, tokens are bytes, as
    raymesh.examples.tinygpt's): its Task's model is the policy, built as a one-rank job would
    build it (torch seeded with `seed`; from the checkpoint `init` when given, as the learner),
    in eval mode. `reward`: (prompt, completion) -> float, or its "module:function" name, or
    a mesh of reward actors (see `raymesh.rl.sampling.score`)."""

    def __init__(
        self,
        policy: Any,
        reward: Reward | str | ActorMesh[Any],
        algorithm: GRPO,
        *,
        seed: int,
        init: str | None = None,
        reward_timeout_s: float = 60.0,
    ) -> None:
        self.reward = reward if isinstance(reward, ActorMesh) else resolve(reward, "reward")
        self.reward_timeout_s = reward_timeout_s
        self.algorithm = algorithm
        self.seed = seed
        task = rebuild(init, build=policy, seed=seed)  # the learner's model, built the same way
        vocab = getattr(task.model, "vocab", None)
        if vocab != 256:
            raise ValueError(
                f"policy={policy!r}: its model has vocab={vocab!r}; generators sample byte-level "
                "policies (vocab = 256, as raymesh.examples.tinygpt's) for now"
            )
        self.model = task.model.eval()
        self.context = getattr(self.model, "block_size", None)

    @endpoint
    def sample(self, items: list[tuple[int, bytes]]) -> list[Rollout]:
        """For each (key, prompt): `group_size` scored completions of `prompt` by the installed
        policy, as a Rollout of that key and version, with `Completions` as its data."""
        out = []
        for key, prompt in items:
            seeds = [
                sample_seed(self.seed, self.version, key, i)
                for i in range(self.algorithm.group_size)
            ]
            tokens, logp = sample_group(
                self.model,
                torch.tensor(list(prompt or b"\n")),
                seeds,
                max_tokens=self.algorithm.max_tokens,
                temperature=self.algorithm.temperature,
                context=self.context,
            )
            texts = [bytes(row.tolist()) for row in tokens]
            rewards, dropped = score(self.reward, prompt, texts, timeout_s=self.reward_timeout_s)
            for index, reason in dropped.items():
                logger.warning("raymesh.rl: key %d completion %d dropped: %s", key, index, reason)
            data = Completions(prompt, tokens, logp, rewards, dropped)
            out.append(Rollout(key=key, version=self.version, data=data))
        return out
