"""The learner role: the policy being trained, stepped by the RL loop.

GRPO's learner is a raymesh.train job the loop drives (`train.drive`): any number of ranks,
any strategy (DDP, FSDP, HSDP), any precision, placed on GPUs where there are, healing a lost
rank under the loop bit for bit, checkpointing as every train job does. The loop turns a step's
rollouts into the job's samples (`completion_samples`: one per completion, its group-relative
advantage computed where the whole group is), and each rank's `GRPOTask` loss takes GRPO's
clipped step on its share: each completion's log-probabilities under the current policy
(teacher-forced after its prompt, at the sampling temperature) against those the generator
recorded, so a rollout made by an older version is corrected by the ratio. Every real token of
the step weighs the same whatever rank trains it (DAPO's token-level mean, over the global
batch). Completions whose reward was dropped take no part; a group with fewer than two left
teaches nothing. Each step makes a new policy version, which `TrainedLearner.weights` hands to
the generators, gathered once from the sharded ranks.

PPO's learner is such a job too (`PPOTask`, `TrainedPPOLearner`): a version's `epochs` passes
over the runners' segments in shuffled minibatches are that many train steps, sent to the
ranks in one call (`DrivenJob.steps`), each a minibatch of columns.
"""

from __future__ import annotations

import collections
import copy
import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from raymesh.actor import Shared
from raymesh.rl.algorithms import (
    GRPO,
    PPO,
    Stats,
    clipped_surrogate,
    group_advantages,
    kl_to_reference,
    ppo_loss,
)
from raymesh.rl.buffer import Rollout
from raymesh.rl.environments import Segment, build_policy, log_prob_and_entropy
from raymesh.rl.sampling import Completions
from raymesh.train import Context, DrivenJob, ShardedState, Task
from raymesh.train.export import rebuild

__all__ = ["GRPOTask", "PPOTask", "TrainedLearner", "TrainedPPOLearner", "completion_samples"]


def completion_samples(rollouts: list[Rollout], version: int) -> tuple[list[dict], Stats]:
    """A GRPO step's samples, one per completion of `rollouts` (the order kept), for the
    learner's ranks; and the loop's figures of the step: mean reward and staleness (against
    `version`, the policy being trained), samples used and dropped (no reward), tokens.

    A sample is a dict: tensors `ids` (the prompt, then the completion but its last token: the
    teacher-forced input), `tokens` and `old` (the generator's log-probabilities), and numbers
    `start` (where the completion's first token is predicted), `counted` (the tokens that
    count: a scored completion's, up to and with its end-of-text token; 0 for a dropped one),
    `advantage` and `scale` (the step's samples over its counted tokens, the same for all: it
    makes the ranks' weighted means the global token-level mean). Numbers, not tensors, where
    one number will do (a step's samples travel to the ranks packed, a buffer per tensor key:
    `raymesh.train.packed`)."""
    out: list[dict] = []
    rewards: list[float] = []
    lag: list[int] = []
    dropped = tokens = 0
    for r in rollouts:
        data: Completions = r.data
        valid = ~torch.isnan(data.rewards)
        adv = torch.zeros(len(data.rewards), dtype=torch.float64)
        if int(valid.sum()) >= 2:
            adv[valid] = group_advantages(data.rewards[valid], int(valid.sum()))
        prompt = data.prompt_ids
        if prompt is None:
            prompt = torch.tensor(list(data.prompt or b"\n"))
        t = data.tokens.shape[1]
        # the tokens after an end-of-text token do not count, nor a dropped completion's
        lengths = data.lengths.tolist() if data.lengths is not None else [t] * len(valid)
        for i in range(len(data.rewards)):
            out.append(
                {
                    "ids": torch.cat([prompt, data.tokens[i, :-1]]).long(),
                    "tokens": data.tokens[i].long(),
                    "old": data.logp[i].float(),
                    "start": len(prompt) - 1,
                    "counted": int(lengths[i]) if bool(valid[i]) else 0,
                    "advantage": float(adv[i]),
                }
            )
        rewards.extend(data.rewards[valid].tolist())
        dropped += len(data.rewards) - int(valid.sum())
        tokens += data.tokens.numel()
        lag.append(version - r.version)
    scale = len(out) / max(sum(s["counted"] for s in out), 1)
    for s in out:
        s["scale"] = scale
    figures: Stats = {
        "reward_mean": sum(rewards) / max(1, len(rewards)),
        "staleness_mean": sum(lag) / max(1, len(lag)),
        "samples": float(len(rewards)),
        "dropped": float(dropped),  # completions whose reward failed: no part in the step
        "tokens": float(tokens),  # generated, dropped samples' included
    }
    return out, figures


def collate_completions(samples: list[dict]) -> dict[str, torch.Tensor]:
    """A batch of `completion_samples`: `ids` padded on the right to the longest (a causal
    model's logits at a position see only what is before it, so a row's values are those of
    its own unpadded forward), the other tensors stacked, the numbers as tensors, and `mask`
    ([B, T], 1.0 where a token counts)."""
    longest = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : len(s["ids"])] = s["ids"]
    tokens = torch.stack([s["tokens"] for s in samples])
    counted = torch.tensor([s["counted"] for s in samples])
    return {
        "ids": ids,
        "tokens": tokens,
        "old": torch.stack([s["old"] for s in samples]),
        "start": torch.tensor([s["start"] for s in samples]),
        "advantage": torch.tensor([s["advantage"] for s in samples]),
        "scale": torch.tensor([s["scale"] for s in samples]),
        "mask": (torch.arange(tokens.shape[1])[None, :] < counted[:, None]).float(),
    }


@dataclass(frozen=True)
class GRPOTask:
    """The build function of GRPO's learner ranks: the policy of `policy` (a raymesh.train
    build function or its name: its Task's model and optimizer), from the checkpoint `init`
    when given, with GRPO's loss over `completion_samples`."""

    policy: Any
    algorithm: GRPO
    init: str | None = None
    params: dict[str, Any] | None = None

    def __call__(self, ctx: Context) -> Task:
        task = rebuild(
            self.init, build=self.policy, device=ctx.device, seed=ctx.seed, params=self.params
        )
        return Task(
            model=task.model.train(),
            optimizer=task.optimizer,
            loss_fn=GRPOLoss(self.algorithm, task.model),
            collate_fn=collate_completions,
            init_weights=task.init_weights,
        )


class GRPOLoss:
    """GRPO's loss on a batch of `completion_samples`, with the clip fraction (and the KL to
    the initial policy, when `algorithm.kl` > 0: a frozen copy of `model` as built) beside it,
    each the token-level sum times the samples' `scale`, averaged over the rows."""

    def __init__(self, algorithm: GRPO, model: nn.Module) -> None:
        self.algorithm = algorithm
        self.reference = None
        if algorithm.kl > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    def __call__(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, Stats]:
        a = self.algorithm
        logp = completion_logp(model, batch, a.temperature)
        surrogate, clipped = clipped_surrogate(
            logp, batch["old"], batch["advantage"][:, None], a.clip
        )
        weight = batch["mask"] * batch["scale"][:, None]
        loss = (surrogate * weight).sum(1).mean()
        stats: Stats = {"clip_fraction": float((clipped * weight).sum(1).mean())}
        if self.reference is not None:
            self.reference.to(batch["ids"].device)
            with torch.no_grad():
                ref = completion_logp(self.reference, batch, a.temperature)
            divergence = (kl_to_reference(logp, ref) * weight).sum(1).mean()
            loss = loss + a.kl * divergence
            stats["kl"] = float(divergence)
        return loss, stats


def completion_logp(model: nn.Module, batch: dict, temperature: float) -> torch.Tensor:
    """[B, T]: the log-probabilities of each row's completion tokens after its prompt under
    `model`, at `temperature`, in one forward of the padded rows."""
    tokens = batch["tokens"]
    t = tokens.shape[1]
    out = model(batch["ids"])
    logits = getattr(out, "logits", out)
    # completion token j of row i is predicted at position start_i + j
    at = (batch["start"][:, None] + torch.arange(t, device=tokens.device))[:, :, None]
    picked = logits.gather(1, at.expand(-1, -1, logits.shape[-1])).float()
    return F.log_softmax(picked / temperature, dim=-1).gather(2, tokens[:, :, None])[:, :, 0]


class _OnJob:
    """A learner role on a driven train job whose policy versions are `per_version` train
    steps each: what the loop calls of either algorithm's to checkpoint and resume."""

    job: DrivenJob
    per_version = 1

    def resumed(self) -> tuple[int, dict[str, Any]]:
        """(the version the job starts from, the loop's position saved with it)."""
        step, extra = self.job.resumed
        return step // self.per_version, extra.get("rl", {})

    def save(self, position: dict[str, Any]) -> str:
        """Checkpoint the policy with the loop's `position`; the step folder."""
        return self.job.save(extra={"rl": position})


class TrainedLearner(_OnJob):
    """GRPO's learner role on a driven train job (`train.drive` of a `GRPOTask`): the loop
    calls its `learn`, `weights`, `save` and `resumed`."""

    def __init__(self, job: DrivenJob) -> None:
        self.job = job

    def learn(self, rollouts: list[Rollout], *, cycle_s: float) -> Stats:
        """One GRPO step on `rollouts` on every rank; the version goes up by one. The step's
        statistics: loss, clip fraction (and KL), the loop's figures (`completion_samples`),
        and `tokens_per_s`: the tokens generated over the loop's cycle of `cycle_s` seconds
        (from the previous update's start to this one's). The figures are in the step's row
        of the run folder too."""
        samples, figures = completion_samples(rollouts, self.job.trained)
        figures["tokens_per_s"] = figures["tokens"] / cycle_s
        row = self.job.step(samples, report=figures)
        keep = ("loss", "clip_fraction", "kl")
        return {**{k: row[k] for k in keep if k in row}, **figures, "version": row["step"]}

    def weights(self) -> tuple[int, Shared[dict[str, torch.Tensor]] | ShardedState]:
        """(the current version, what trains of its weights, stored once: a sharded learner's
        shards where its ranks are, which each reader assembles)."""
        return self.job.trained, self.job.weights(trained_only=True)


@dataclass(frozen=True)
class PPOTask:
    """The build function of PPO's learner ranks: the policy for `algorithm.env` (`policy`:
    see raymesh.rl.environments) with Adam at `algorithm.lr`, and PPO's loss on a minibatch
    (columns: obs, actions, old log-probabilities, advantages normalised over the minibatch,
    returns)."""

    policy: Any
    algorithm: PPO

    def __call__(self, ctx: Context) -> Task:
        model = build_policy(self.policy, self.algorithm.env, ctx.seed).train()
        # fused: one kernel for the whole update; for a small policy the per-parameter loop of
        # the default Adam is a third of a minibatch's time on a CPU.
        optimizer = torch.optim.Adam(model.parameters(), lr=self.algorithm.lr, eps=1e-5, fused=True)
        return Task(
            model=model, optimizer=optimizer, loss_fn=functools.partial(_ppo, self.algorithm)
        )


def _ppo(algorithm: PPO, model: nn.Module, batch: dict) -> tuple[torch.Tensor, Stats]:
    a = algorithm
    logits, values = model(batch["obs"])
    logp, entropy = log_prob_and_entropy(logits, batch["actions"])
    return ppo_loss(
        logp,
        batch["old"],
        batch["advantages"],
        values,
        batch["returns"],
        entropy,
        clip=a.clip,
        value_coef=a.value_coef,
        entropy_coef=a.entropy_coef,
    )


class TrainedPPOLearner(_OnJob):
    """PPO's learner role on a driven train job (of a `PPOTask`): `learn(rollouts)` makes
    `epochs` passes over the runners' segments (advantages and returns already computed where
    the values were) in shuffled minibatches, one train step each (gradients clipped to
    `max_grad_norm` by the job), all of a version's in one call to the ranks. The minibatch
    order is drawn from (seed, version), so a run is reproducible. `episode_return_mean` is
    over the last 100 episodes finished (as RLlib's), NaN before the first."""

    def __init__(self, job: DrivenJob, algorithm: PPO, *, seed: int, samples: int) -> None:
        self.job = job
        self.algorithm = algorithm
        self.seed = seed
        self.size, self.per_version = self.shape(algorithm, samples)
        self.episodes: collections.deque[float] = collections.deque(maxlen=100)

    @staticmethod
    def shape(algorithm: PPO, samples: int) -> tuple[int, int]:
        """(samples a train step takes, train steps a version), for `samples` a version."""
        size = max(1, samples // algorithm.minibatches)
        return size, algorithm.epochs * (samples // size)

    @property
    def version(self) -> int:
        return self.job.trained // self.per_version

    def learn(self, rollouts: list[Rollout], *, cycle_s: float) -> Stats:
        """One PPO version on `rollouts`: `epochs` passes of minibatches, a train step each;
        their mean losses and the loop's figures (in the version's last row of the run
        folder), with `env_steps_per_s` over the loop's cycle (see `TrainedLearner.learn`)."""
        a, version = self.algorithm, self.version
        parts: list[Segment] = [r.data for r in rollouts]
        obs = torch.cat([p.obs for p in parts])
        actions = torch.cat([p.actions for p in parts])
        old = torch.cat([p.logp for p in parts])
        advantages = torch.cat([p.advantages for p in parts])
        returns = torch.cat([p.returns for p in parts])
        order = torch.Generator().manual_seed(self.seed * 1_000_003 + version)
        batches = []
        for _ in range(a.epochs):
            perm = torch.randperm(len(actions), generator=order)
            for start in range(0, len(actions) - self.size + 1, self.size):
                i = perm[start : start + self.size]
                adv = advantages[i]
                adv = (adv - adv.mean()) / (adv.std() + 1e-8) if len(i) > 1 else adv
                batches.append(
                    {"obs": obs[i], "actions": actions[i], "old": old[i], "advantages": adv,
                     "returns": returns[i]}
                )  # fmt: skip
        episodes = [e for p in parts for e in p.episodes]
        self.episodes.extend(episodes)
        figures = {  # the loop's figures of the version, in its last step's row
            "env_steps": float(len(actions)),
            "env_steps_per_s": len(actions) / cycle_s,
            "episodes": float(len(episodes)),
            "episode_return_mean": (
                sum(self.episodes) / len(self.episodes) if self.episodes else math.nan
            ),
            "staleness_mean": sum(version - r.version for r in rollouts) / max(1, len(rollouts)),
            "version": float(version + 1),
        }
        rows = self.job.steps(batches, report=figures)
        keys = ("policy_loss", "value_loss", "entropy", "clip_fraction")
        return {**{k: sum(r[k] for r in rows) / len(rows) for k in keys}, **figures}

    def weights(self) -> tuple[int, Shared[dict[str, torch.Tensor]] | ShardedState]:
        return self.version, self.job.weights()
