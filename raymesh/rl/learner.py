"""The learner role: the policy being trained, one proc, stepped by the RL loop with GRPO.

`learn(rollouts)` turns a step's rollouts into one optimizer step: each completion's
log-probabilities under the current policy (teacher-forced after its prompt, at the sampling
temperature), its group-relative advantage, and GRPO's clipped loss against the
log-probabilities the generator recorded, so a rollout made by an older version is corrected
by the ratio. Completions whose reward was dropped take no part; a group with fewer than two
left teaches nothing. Each step makes a new policy version, which `weights()` hands to the
generators.

`PPOLearner` is the same role for environments: `learn(rollouts)` takes the runners' segments
(advantages and returns already computed where the values were) and makes `epochs` passes over
them in `minibatches` shuffled minibatches, with PPO's clipped loss, advantages normalised per
minibatch and gradients clipped to `max_grad_norm`.

Each learner is one process. Running the trainer as a raymesh.train job (any strategy,
healing) is the part of issue 36 still to build.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from raymesh.actor import Actor, Shared, endpoint
from raymesh.rl.algorithms import GRPO, PPO, Stats, group_advantages, grpo_loss, ppo_loss
from raymesh.rl.buffer import Rollout
from raymesh.rl.codec import context_of
from raymesh.rl.environments import Segment, build_policy, log_prob_and_entropy
from raymesh.rl.sampling import Completions
from raymesh.train import TrainConfig
from raymesh.train.checkpoint import Checkpointer, resolve_checkpoint
from raymesh.train.export import job_config, rebuild

__all__ = ["Learner", "PPOLearner"]


class Learner(Actor):
    """The policy of `policy` (a raymesh.train build function or its name: its Task's model
    and optimizer), from the checkpoint `init` when given, seeded with `seed`."""

    def __init__(
        self,
        policy: Any,
        algorithm: GRPO,
        *,
        seed: int,
        init: str | None,
        params: dict[str, Any] | None = None,
        resume: str | None = None,
    ) -> None:
        # What a checkpoint of the policy records as its job: the init's (so `raymesh serve`
        # and `export` rebuild the model as it was trained), naming this build function.
        if init is not None:
            config = job_config(resolve_checkpoint(init))
        else:
            config = TrainConfig(params=params or {})
        build = policy if isinstance(policy, str) else config.build
        self.config = dataclasses.replace(config, build=build).to_dict()
        task = rebuild(init, build=policy, seed=seed, params=params)
        self.model = task.model.train()
        self.optimizer = task.optimizer
        self.algorithm = algorithm
        self.context = context_of(self.model)
        # Only what trains changes: a LoRA policy publishes its adapters alone.
        self.trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
        self.version = 0
        # GRPO's KL is to the initial policy: a frozen copy, kept only when the KL is weighed
        self.reference = None
        if algorithm.kl > 0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.position: dict[str, Any] = {}
        if resume is not None:  # a step folder the controller found committed and verified
            manifest = Checkpointer(Path(resume).parent).load(resume, self.model, self.optimizer)
            self.version = manifest.step
            # checked by the controller before it acts on it (raymesh.rl.position)
            self.position = manifest.extra.get("rl", {})

    @endpoint
    def resumed(self) -> tuple[int, dict[str, Any]]:
        """(the version this learner starts from, the loop's position saved with it)."""
        return self.version, self.position

    @endpoint
    def weights(self) -> tuple[int, Shared[dict[str, torch.Tensor]]]:
        """(the current version, its weights, stored once in this host's object store): the
        loop hands the reference to every generator, and each reads the one copy."""
        state = self.model.state_dict()
        if len(self.trained) < len(state):
            state = {k: v for k, v in state.items() if k in self.trained}
        return self.version, Shared(state)

    @endpoint
    def save(self, folder: str, position: dict[str, Any]) -> str:
        """Checkpoint the policy and its optimizer in `folder` as raymesh.train does (step =
        the version), which `raymesh serve --checkpoint`, `export` and `init=` read, with the
        loop's `position` (which samples it has taken), which a resumed run continues from;
        returns the step folder. The newest two are kept."""
        Checkpointer(folder, keep=2).save(
            self.version,
            self.model,
            self.optimizer,
            world_size=1,
            strategy="ddp",
            config=self.config,
            data_position=self.version,
            rank=0,
            extra={"rl": position},
        )
        return str(resolve_checkpoint(folder))

    @endpoint
    def learn(self, rollouts: list[Rollout]) -> Stats:
        """One GRPO step on `rollouts`; the policy's version goes up by one. Returns the
        step's statistics: loss, clip fraction, mean reward and staleness, samples used and
        dropped (no reward), and the KL to the initial policy when `algorithm.kl` > 0."""
        a = self.algorithm
        prompts, completions, old, advantages, mask, rewards, lag = [], [], [], [], [], [], []
        dropped = 0
        for r in rollouts:
            data: Completions = r.data
            valid = ~torch.isnan(data.rewards)
            adv = torch.zeros(len(data.rewards), dtype=torch.float64)
            if int(valid.sum()) >= 2:
                adv[valid] = group_advantages(data.rewards[valid], int(valid.sum()))
            prompt = data.prompt_ids
            if prompt is None:
                prompt = torch.tensor(list(data.prompt or b"\n"))
            prompts.extend([prompt] * len(data.rewards))
            completions.append(data.tokens)
            old.append(data.logp)
            advantages.append(adv)
            t = data.tokens.shape[1]
            counted = torch.ones_like(data.tokens, dtype=torch.bool)
            if data.lengths is not None:  # the tokens after an end-of-text token
                counted = torch.arange(t)[None, :] < data.lengths[:, None]
            mask.append(valid[:, None] & counted)
            rewards.extend(data.rewards[valid].tolist())
            dropped += len(data.rewards) - int(valid.sum())
            lag.append(self.version - r.version)
        tokens = torch.cat(completions)
        new = self._logp(self.model, prompts, tokens)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self._logp(self.reference, prompts, tokens)
        masks = torch.cat(mask).to(new.dtype)
        loss, stats = grpo_loss(
            new,
            torch.cat(old),
            torch.cat(advantages).to(new.dtype),
            masks,
            clip=a.clip,
            kl=a.kl,
            logp_ref=ref,
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
            "dropped": float(dropped),  # completions whose reward failed: no part in the step
            "tokens": float(tokens.numel()),  # generated, dropped samples' included
            "version": float(self.version),
        }

    def _logp(
        self, model: nn.Module, prompts: list[torch.Tensor], completions: torch.Tensor
    ) -> torch.Tensor:
        """[N, T]: the log-probabilities of completion i's tokens after prompt i under `model`,
        at the sampling temperature, in one forward. The rows are padded on the right: a
        causal model's logits at a position see only what is before it, and every row starts
        at position 0, so a row's values are those of its own unpadded forward."""
        t = completions.shape[1]
        longest = max(len(p) for p in prompts) + t - 1
        if self.context is not None and longest > self.context:
            raise ValueError(
                f"a prompt of {longest - t + 1} tokens and max_tokens={t} exceed the policy's "
                f"context of {self.context} tokens; lower max_tokens or the prompts"
            )
        ids = torch.zeros(len(prompts), longest, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p) + t - 1] = torch.cat([p, completions[i, :-1]])
        out = model(ids)
        logits = getattr(out, "logits", out)
        # completion token j of row i is predicted at position len(prompt i) - 1 + j
        starts = torch.tensor([len(p) - 1 for p in prompts])
        at = (starts[:, None] + torch.arange(t))[:, :, None]
        picked = logits.gather(1, at.expand(-1, -1, logits.shape[-1])).float()
        logp = F.log_softmax(picked / self.algorithm.temperature, dim=-1)
        return logp.gather(2, completions[:, :, None].long())[:, :, 0]


class PPOLearner(Actor):
    """The PPO policy for `algorithm.env` (`policy`: see raymesh.rl.environments), seeded
    with `seed`, trained with Adam at `algorithm.lr`."""

    def __init__(self, policy: Any, algorithm: PPO, *, seed: int) -> None:
        self.model = build_policy(policy, algorithm.env, seed).train()
        # fused: one kernel for the whole update; for a small policy the per-parameter loop of
        # the default Adam is a third of a minibatch's time on a CPU.
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=algorithm.lr, eps=1e-5, fused=True
        )
        self.algorithm = algorithm
        self.seed = seed
        self.version = 0
        self.episodes: collections.deque[float] = collections.deque(maxlen=100)

    @endpoint
    def weights(self) -> tuple[int, Shared[dict[str, torch.Tensor]]]:
        """(the current version, its weights), as `Learner.weights`."""
        return self.version, Shared(self.model.state_dict())

    @endpoint
    def learn(self, rollouts: list[Rollout]) -> Stats:
        """PPO's passes over `rollouts` (segments); the version goes up by one. The minibatch
        order is drawn from (seed, version), so a run is reproducible. `episode_return_mean`
        is over the last 100 episodes finished (as RLlib's), NaN before the first."""
        a = self.algorithm
        parts: list[Segment] = [r.data for r in rollouts]
        obs = torch.cat([p.obs for p in parts])
        actions = torch.cat([p.actions for p in parts])
        old = torch.cat([p.logp for p in parts])
        advantages = torch.cat([p.advantages for p in parts])
        returns = torch.cat([p.returns for p in parts])
        order = torch.Generator().manual_seed(self.seed * 1_000_003 + self.version)
        size = max(1, len(actions) // a.minibatches)
        totals: dict[str, float] = {}
        updates = 0
        for _ in range(a.epochs):
            perm = torch.randperm(len(actions), generator=order)
            for start in range(0, len(actions) - size + 1, size):
                i = perm[start : start + size]
                logits, values = self.model(obs[i])
                logp, entropy = log_prob_and_entropy(logits, actions[i])
                adv = advantages[i]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8) if len(i) > 1 else adv
                loss, stats = ppo_loss(
                    logp,
                    old[i],
                    adv,
                    values,
                    returns[i],
                    entropy,
                    clip=a.clip,
                    value_coef=a.value_coef,
                    entropy_coef=a.entropy_coef,
                )
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.model.parameters(), a.max_grad_norm, foreach=True)
                self.optimizer.step()
                for k, v in stats.items():
                    totals[k] = totals.get(k, 0.0) + v
                updates += 1
        self.version += 1
        episodes = [e for p in parts for e in p.episodes]
        self.episodes.extend(episodes)
        lag = [self.version - 1 - r.version for r in rollouts]
        return {
            **{k: v / updates for k, v in totals.items()},
            "env_steps": float(len(actions)),
            "episodes": float(len(episodes)),
            "episode_return_mean": (
                sum(self.episodes) / len(self.episodes) if self.episodes else math.nan
            ),
            "staleness_mean": sum(lag) / max(1, len(lag)),
            "version": float(self.version),
        }
