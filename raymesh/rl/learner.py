"""The learner role: the policy being trained, one proc, stepped by the RL loop with GRPO.

`learn(rollouts)` turns a step's rollouts into one optimizer step: each completion's
log-probabilities under the current policy (teacher-forced after its prompt, at the sampling
temperature), its group-relative advantage, and GRPO's clipped loss against the
log-probabilities the generator recorded, so a rollout made by an older version is corrected
by the ratio. Completions whose reward was dropped take no part; a group with fewer than two
left teaches nothing. Each step makes a new policy version, which `weights()` hands to the
generators.

This learner is one process. Running the trainer as a raymesh.train job (any strategy,
healing) is the part of issue 36 still to build.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from raymesh.actor import Actor, Shared, endpoint
from raymesh.rl.algorithms import GRPO, Stats, group_advantages, grpo_loss
from raymesh.rl.buffer import Rollout
from raymesh.rl.sampling import Completions
from raymesh.train import TrainConfig
from raymesh.train.checkpoint import Checkpointer, resolve_checkpoint
from raymesh.train.export import job_config, rebuild

__all__ = ["Learner"]


class Learner(Actor):
    """The policy of `policy` (a raymesh.train build function or its name: its Task's model
    and optimizer), from the checkpoint `init` when given, seeded with `seed`."""

    def __init__(self, policy: Any, algorithm: GRPO, *, seed: int, init: str | None) -> None:
        # What a checkpoint of the policy records as its job: the init's (so `raymesh serve`
        # and `export` rebuild the model as it was trained), naming this build function.
        config = job_config(resolve_checkpoint(init)) if init is not None else TrainConfig()
        build = policy if isinstance(policy, str) else config.build
        self.config = dataclasses.replace(config, build=build).to_dict()
        task = rebuild(init, build=policy, seed=seed)
        self.model = task.model.train()
        self.optimizer = task.optimizer
        self.algorithm = algorithm
        self.context = getattr(self.model, "block_size", None)
        self.version = 0

    @endpoint
    def weights(self) -> tuple[int, Shared[dict[str, torch.Tensor]]]:
        """(the current version, its weights, stored once in this host's object store): the
        loop hands the reference to every generator, and each reads the one copy."""
        return self.version, Shared(self.model.state_dict())

    @endpoint
    def save(self, folder: str) -> str:
        """Checkpoint the policy and its optimizer in `folder` as raymesh.train does (step =
        the version), which `raymesh serve --checkpoint`, `export` and `init=` read; returns
        the step folder."""
        Checkpointer(folder, keep=1).save(
            self.version,
            self.model,
            self.optimizer,
            world_size=1,
            strategy="ddp",
            config=self.config,
            data_position=self.version,
            rank=0,
        )
        return str(resolve_checkpoint(folder))

    @endpoint
    def learn(self, rollouts: list[Rollout]) -> Stats:
        """One GRPO step on `rollouts`; the policy's version goes up by one. Returns the
        step's statistics: loss, clip fraction, mean reward and staleness, samples used."""
        a = self.algorithm
        tokens, old, advantages, mask, rewards, lag = [], [], [], [], [], []
        for r in rollouts:
            data: Completions = r.data
            valid = ~torch.isnan(data.rewards)
            adv = torch.zeros(len(data.rewards), dtype=torch.float64)
            if int(valid.sum()) >= 2:
                adv[valid] = group_advantages(data.rewards[valid], int(valid.sum()))
            prompt = torch.tensor(list(data.prompt or b"\n"))
            for i in range(len(data.rewards)):
                tokens.append((prompt, data.tokens[i]))
                old.append(data.logp[i])
                advantages.append(float(adv[i]))
                mask.append(float(valid[i]))
            rewards.extend(data.rewards[valid].tolist())
            lag.append(self.version - r.version)
        new = torch.stack([self._logp(p, t) for p, t in tokens])
        old_t = torch.stack(old)
        masks = torch.tensor(mask)[:, None].expand_as(new)
        loss, stats = grpo_loss(
            new, old_t, torch.tensor(advantages, dtype=new.dtype), masks, clip=a.clip
        )
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.version += 1
        return {
            **stats,
            "loss": loss.item(),
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "staleness_mean": sum(lag) / max(1, len(lag)),
            "samples": float(len(rewards)),
            "version": float(self.version),
        }

    def _logp(self, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
        """The log-probabilities of `completion`'s tokens after `prompt`, at the sampling
        temperature, with gradients."""
        ids = torch.cat([prompt, completion])[None, :-1]
        if self.context is not None and ids.shape[1] > self.context:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens and max_tokens={len(completion)} exceed the "
                f"policy's context of {self.context} tokens; lower max_tokens or the prompts"
            )
        out = self.model(ids)
        logits = getattr(out, "logits", out)[0, len(prompt) - 1 :].float()
        logp = F.log_softmax(logits / self.algorithm.temperature, dim=-1)
        return logp.gather(1, completion[:, None].long())[:, 0]
