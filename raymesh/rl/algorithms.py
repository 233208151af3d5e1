"""The learning rules, as pure functions of tensors: GRPO for language models, PPO with GAE for
environments. No model, no Ray, no process group: the RL loop computes log-probabilities,
values and rewards, and these turn them into advantages and a loss. Each is small enough to
check by hand, and `tests/unit/test_rl_algorithms.py` does, with made-up numbers.

Conventions (the same in both):
- `logp_*` are per-token (GRPO: [B, T]) or per-step (PPO: [N]) log-probabilities of the
  actions taken; `mask` marks the real completion tokens (1) among padding (0).
- The importance ratio is exp(logp_new - logp_old), where "old" is the policy that sampled the
  action: a sample made by an older policy version (`max_staleness` > 0) is corrected by it,
  and clipped to [1 - clip, 1 + clip] as PPO clips it.
- Losses are to be minimised; each returns (loss, stats), stats plain floats for the reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from raymesh._common import bad, check_int

__all__ = [
    "GRPO",
    "PPO",
    "Stats",
    "clipped_surrogate",
    "gae",
    "group_advantages",
    "grpo_loss",
    "kl_to_reference",
    "ppo_loss",
]


def _check_fraction(field: str, value: object, low: float, high: float, fix: str) -> None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not low <= float(value) <= high or math.isnan(float(value)):  # type: ignore[arg-type]
        raise bad(field, value, fix)


@dataclass(frozen=True, kw_only=True)
class GRPO:
    """Group-relative policy optimisation (DeepSeekMath): each prompt is answered
    `group_size` times, and a completion's advantage is its reward's z-score within its group,
    so no value model is needed."""

    group_size: int = 8  # completions per prompt; their rewards are compared with each other
    clip: float = 0.2  # the importance ratio is clipped to [1 - clip, 1 + clip]
    kl: float = 0.0  # weight of the KL to the reference (initial) policy; 0: no reference kept
    max_tokens: int = 64  # tokens a completion may have
    temperature: float = 1.0  # sampling temperature of the generators

    def __post_init__(self) -> None:
        check_int("group_size", self.group_size, minimum=2)  # one answer compares with nothing
        _check_fraction("clip", self.clip, 0.0, 1.0, "give a fraction in [0, 1], e.g. 0.2")
        _check_fraction("kl", self.kl, 0.0, math.inf, "give a weight >= 0 (0: no KL term)")
        check_int("max_tokens", self.max_tokens, minimum=1)
        _check_fraction("temperature", self.temperature, 1e-6, math.inf, "give a number > 0")


@dataclass(frozen=True, kw_only=True)
class PPO:
    """Proximal policy optimisation with generalised advantage estimation (Schulman et al.),
    for gymnasium environments stepped by `env_runners`."""

    env: str  # a gymnasium environment id, e.g. "CartPole-v1"
    gamma: float = 0.99  # discount
    lam: float = 0.95  # GAE's lambda: 0 is one-step TD, 1 is Monte Carlo
    clip: float = 0.2
    value_coef: float = 0.5  # weight of the value loss
    entropy_coef: float = 0.0  # weight of the entropy bonus
    epochs: int = 4  # passes over each batch of rollouts
    minibatches: int = 4  # optimizer steps per pass (the batch split this many ways)
    rollout_steps: int = 128  # environment steps per runner per batch
    envs_per_runner: int = 8  # environment copies each runner steps together
    lr: float = 2.5e-4  # Adam's learning rate
    max_grad_norm: float = 0.5  # gradients clipped to this norm

    def __post_init__(self) -> None:
        if not isinstance(self.env, str) or not self.env:
            raise bad("env", self.env, 'give a gymnasium environment id, e.g. "CartPole-v1"')
        for field in ("gamma", "lam", "clip"):
            _check_fraction(field, getattr(self, field), 0.0, 1.0, "give a number in [0, 1]")
        for field in ("value_coef", "entropy_coef"):
            _check_fraction(field, getattr(self, field), 0.0, math.inf, "give a weight >= 0")
        _check_fraction("lr", self.lr, 1e-12, 1.0, "give a learning rate in (0, 1], e.g. 2.5e-4")
        _check_fraction("max_grad_norm", self.max_grad_norm, 1e-12, math.inf, "give a norm > 0")
        for field in ("epochs", "minibatches", "rollout_steps", "envs_per_runner"):
            check_int(field, getattr(self, field), minimum=1)


Stats = dict[str, float]


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """Each reward's z-score within its group: `rewards` [G * group_size], the groups one after
    another; (r - mean) / (std + eps), std the sample standard deviation (as GRPO's authors and
    TRL compute it). A group whose rewards are all equal teaches nothing: its advantages are 0.
    ValueError when the rewards do not split into groups of `group_size`."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards of shape {list(rewards.shape)} do not split into groups of "
            f"group_size={group_size}; give one reward per completion, groups together"
        )
    groups = rewards.double().view(-1, group_size)
    centred = groups - groups.mean(dim=1, keepdim=True)
    advantages = centred / (groups.std(dim=1, keepdim=True) + eps)
    return advantages.view(-1).to(rewards.dtype)


def clipped_surrogate(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped objective, elementwise, negated to be minimised:
    -min(ratio * A, clip(ratio, 1 - clip, 1 + clip) * A), and where the clip was the minimum
    (those elements pass no gradient). `advantages` broadcasts against the log-probabilities."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1 - clip, 1 + clip) * advantages
    return -torch.minimum(unclipped, clipped), clipped < unclipped


def kl_to_reference(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """The per-token KL(new || reference) estimate GRPO uses (Schulman's k3): exp(d) - d - 1
    with d = logp_ref - logp_new; unbiased, and never negative."""
    d = logp_ref - logp_new
    return torch.exp(d) - d - 1


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float,
    kl: float = 0.0,
    logp_ref: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GRPO's loss over a batch of completions: the clipped surrogate of every real token with
    its completion's advantage (`advantages` [B], the tokens [B, T]), plus `kl` times the KL to
    the reference policy, averaged over all real tokens of the batch (each token weighs the
    same, so a long completion is not diluted: DAPO's token-level mean). ValueError when
    `kl` > 0 and `logp_ref` is None."""
    mask = mask.to(logp_new.dtype)
    surrogate, clipped = clipped_surrogate(logp_new, logp_old, advantages[:, None], clip)
    loss = _masked_mean(surrogate, mask)
    stats: Stats = {"clip_fraction": float(_masked_mean(clipped.to(mask.dtype), mask))}
    if kl > 0:
        if logp_ref is None:
            raise ValueError("kl > 0 needs the reference policy's log-probabilities (logp_ref)")
        divergence = _masked_mean(kl_to_reference(logp_new, logp_ref), mask)
        loss = loss + kl * divergence
        stats["kl"] = divergence.item()
    return loss, stats


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    dones: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over `rewards` [T, N] (T steps of N environments),
    `values` [T + 1, N] (the last row: the value of the state after the last step), `dones`
    [T, N] (1 where the step ended its episode: nothing after it is bootstrapped). Returns
    (advantages, returns) [T, N], returns = advantages + values[:T] (the value targets).

    delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t;
    A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}."""
    steps = rewards.shape[0]
    if values.shape[0] != steps + 1 or dones.shape != rewards.shape:
        raise ValueError(
            f"gae: rewards {list(rewards.shape)}, values {list(values.shape)} and dones "
            f"{list(dones.shape)}: give values one row longer (the state after the last step) "
            "and dones of the rewards' shape"
        )
    live = 1.0 - dones.to(values.dtype)
    advantages = torch.zeros_like(rewards, dtype=values.dtype)
    carry = torch.zeros_like(values[0])
    for t in reversed(range(steps)):
        delta = rewards[t] + gamma * values[t + 1] * live[t] - values[t]
        carry = delta + gamma * lam * live[t] * carry
        advantages[t] = carry
    return advantages, advantages + values[:steps]


def ppo_loss(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    values_new: torch.Tensor,
    returns: torch.Tensor,
    entropy: torch.Tensor,
    *,
    clip: float,
    value_coef: float,
    entropy_coef: float,
) -> tuple[torch.Tensor, Stats]:
    """PPO's loss over a minibatch of steps (all [N]): the clipped surrogate's mean, plus
    `value_coef` times the mean squared error of the values against the returns, minus
    `entropy_coef` times the mean entropy (a bonus for exploring)."""
    surrogate, clipped = clipped_surrogate(logp_new, logp_old, advantages, clip)
    policy = surrogate.mean()
    value = (values_new - returns).pow(2).mean()
    bonus = entropy.mean()
    loss = policy + value_coef * value - entropy_coef * bonus
    return loss, {
        "policy_loss": policy.item(),
        "value_loss": value.item(),
        "entropy": bonus.item(),
        "clip_fraction": float(clipped.float().mean()),
    }
