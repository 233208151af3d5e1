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
from raymesh.rl.codec import codec_of, context_of
from raymesh.rl.policy_copy import PolicyCopy
from raymesh.rl.sampling import Completions, Reward, sample_group, sample_seed, score
from raymesh.train.checkpoint import resolve_checkpoint
from raymesh.train.export import job_config, rebuild

__all__ = ["Generator"]

logger = logging.getLogger("raymesh")


class Generator(PolicyCopy):
    """One generator proc. `policy` is a raymesh.train build function (or its
    "module:function" name) of a byte-level model (vocab 256, as raymesh.examples.tinygpt's)
    or of a transformers causal LM with its tokenizer (raymesh.train.hf:build, with `params`
    as its ctx.params): its Task's model is the policy, built as a one-rank job would build it
    (torch seeded with `seed`; from the checkpoint `init` when given, as the learner), in eval
    mode. `reward`: (prompt, completion) -> float, or its "module:function" name, or
    a mesh of reward actors (see `raymesh.rl.sampling.score`)."""

    def __init__(
        self,
        policy: Any,
        reward: Reward | str | ActorMesh[Any],
        algorithm: GRPO,
        *,
        seed: int,
        init: str | None = None,
        params: dict[str, Any] | None = None,
        reward_timeout_s: float = 60.0,
    ) -> None:
        self.reward = reward if isinstance(reward, ActorMesh) else resolve(reward, "reward")
        self.reward_timeout_s = reward_timeout_s
        self.algorithm = algorithm
        self.seed = seed
        # the learner's model, built the same way
        try:
            task = rebuild(init, build=policy, seed=seed, params=params)
        except ValueError as e:
            if init is None:
                raise
            # e.g. a policy of another vocabulary or size than the one init's job trained
            trained = job_config(resolve_checkpoint(init)).build
            fix = f" (init's job trained policy={trained!r})" if trained != policy else ""
            raise ValueError(f"init={init!r} does not fit policy={policy!r}{fix}: {e}") from None
        self.codec = codec_of(task.model, policy)
        self.model = task.model.eval()
        self.context = context_of(self.model)

    @endpoint
    def measure(self, prompts: list[bytes]) -> tuple[int | None, list[int]]:
        """(the most tokens the policy sees, None when it says not; each prompt's tokens)."""
        return self.context, [len(self.codec.encode(p)) for p in prompts]

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
            prompt_ids = self.codec.encode(prompt)
            tokens, logp = sample_group(
                self.model,
                prompt_ids,
                seeds,
                max_tokens=self.algorithm.max_tokens,
                temperature=self.algorithm.temperature,
                context=self.context,
            )
            lengths = _lengths(tokens, self.codec.eos)
            # the text ends before the end-of-text token; the token itself is learned
            texts = [
                self.codec.decode(
                    row[: n - int(self.codec.eos is not None and row[n - 1] == self.codec.eos)]
                )
                for row, n in zip(tokens, lengths.tolist())
            ]
            rewards, dropped = score(self.reward, prompt, texts, timeout_s=self.reward_timeout_s)
            for index, reason in dropped.items():
                logger.warning("raymesh.rl: key %d completion %d dropped: %s", key, index, reason)
            data = Completions(prompt, tokens, logp, rewards, dropped, prompt_ids, lengths)
            out.append(Rollout(key=key, version=self.version, data=data))
        return out


def _lengths(tokens: torch.Tensor, eos: int | None) -> torch.Tensor:
    """Each row's length: up to and with its first `eos`, else all its tokens."""
    t = tokens.shape[1]
    if eos is None:
        return torch.full((tokens.shape[0],), t, dtype=torch.long)
    hit = tokens == eos
    first = torch.where(
        hit.any(dim=1),
        hit.float().argmax(dim=1),
        torch.full_like(hit[:, 0], t - 1, dtype=torch.long),
    )
    return first + 1
