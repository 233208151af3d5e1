"""Environment RL: gymnasium environments stepped on runner procs, PPO's rollouts.

An `EnvRunner` holds `envs_per_runner` copies of the environment (one gymnasium vector env,
stepped in this proc) and a copy of the policy. `load(version, state)` installs the version the
learner published; `sample(keys)` steps the environments `rollout_steps` times per key under
the installed policy and returns one `Segment` per key: the observations, actions, their
log-probabilities, and GAE advantages and returns computed here, where the values are (the
learner gets what it trains on and nothing else).

Episodes run on across segments; an episode cut by the environment's time limit is
bootstrapped with the value of its last observation (not treated as a failure), one ended by
the environment counts nothing after it. Each finished episode's return travels with its
segment. Sampling is seeded by (seed, runner index, incarnation): a runner that replaces a dead
one starts fresh environments, so env RL is reproducible run to run but not through a fault
(the GRPO loop is: its samples are functions of their keys).

The policy: `policy=None` is `ActorCritic`, a two-layer tanh MLP with a policy and a value
head, as in CleanRL's PPO; or "module:function" (or the function) taking the observation and
action spaces and returning a module whose forward(obs) gives (action logits, value).
Discrete actions only, for now.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from raymesh._common import bad, resolve
from raymesh.actor import endpoint
from raymesh.rl.algorithms import PPO, gae
from raymesh.rl.buffer import Rollout
from raymesh.rl.policy_copy import PolicyCopy

__all__ = [
    "ActorCritic",
    "EnvRunner",
    "Segment",
    "build_policy",
    "log_prob_and_entropy",
    "make_envs",
    "spaces",
]


def _gym() -> Any:
    try:
        import gymnasium
    except ImportError as e:  # an optional dependency: say how to get it
        raise ImportError("environment RL needs gymnasium: pip install 'raymesh[rl]'") from e
    return gymnasium


def spaces(env: str) -> tuple[Any, Any]:
    """The (observation, action) spaces of gymnasium environment `env`; ValueError naming the
    field for an unknown id or one this module cannot train (not Discrete actions, not a flat
    Box of observations). Cheap: it is called before any proc starts."""
    gym = _gym()
    try:
        probe = gym.make(env)
    except gym.error.Error as e:
        raise bad(
            "env", env, f"not a registered gymnasium environment ({e}); e.g. 'CartPole-v1'"
        ) from None
    try:
        obs, act = probe.observation_space, probe.action_space
    finally:
        probe.close()
    if not isinstance(act, gym.spaces.Discrete):
        raise bad("env", env, f"its actions are {act}; PPO here trains Discrete actions only")
    if not isinstance(obs, gym.spaces.Box) or len(obs.shape) != 1:
        raise bad("env", env, f"its observations are {obs}; give one with a flat Box of them")
    return obs, act


def make_envs(env: str, count: int, seed: int) -> Any:
    """`count` copies of `env` as one vector env, reset with seeds seed .. seed + count - 1.
    An episode that ends is reset in the same step (its last observation in
    info["final_obs"]), so each step's observation is the one the next action is taken on."""
    gym = _gym()
    envs = gym.make_vec(
        env,
        num_envs=count,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    envs.reset(seed=[seed + i for i in range(count)])
    return envs


class ActorCritic(nn.Module):
    """The default policy: separate two-layer tanh MLPs for the action logits and the value."""

    def __init__(self, observations: int, actions: int, hidden: int = 64) -> None:
        super().__init__()

        def mlp(out: int, gain: float) -> nn.Sequential:
            layers = [nn.Linear(observations, hidden), nn.Linear(hidden, hidden)]
            head = nn.Linear(hidden, out)
            for layer in layers:  # orthogonal init, as PPO implementations do
                nn.init.orthogonal_(layer.weight, 2**0.5)
                nn.init.zeros_(layer.bias)
            nn.init.orthogonal_(head.weight, gain)
            nn.init.zeros_(head.bias)
            return nn.Sequential(layers[0], nn.Tanh(), layers[1], nn.Tanh(), head)

        self.actor = mlp(actions, 0.01)  # near-uniform first actions
        self.critic = mlp(1, 1.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.actor(obs), self.critic(obs).squeeze(-1)


def log_prob_and_entropy(
    logits: torch.Tensor, actions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probability of each action, entropy of each row) of a categorical over `logits`
    [N, A]: what torch.distributions.Categorical gives, without its per-call checks (a fifth
    of a small PPO minibatch's time)."""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, actions[:, None])[:, 0], -(logp.exp() * logp).sum(-1)


def build_policy(policy: str | Callable[..., Any] | None, env: str, seed: int) -> nn.Module:
    """The policy module for `env`, its weights drawn from torch seeded with `seed` (so the
    learner and every runner build the same one)."""
    obs, act = spaces(env)
    torch.manual_seed(seed)
    if policy is None:
        return ActorCritic(int(obs.shape[0]), int(act.n))
    module = resolve(policy, "policy")(obs, act)
    if not isinstance(module, nn.Module):
        raise TypeError(f"policy={policy!r} returned {type(module).__name__}; return an nn.Module")
    return module


def _seed(*parts: int) -> int:
    text = ":".join(["raymesh.rl.env", *map(str, parts)]).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=4).digest(), "little")


@dataclass
class Segment:
    """One runner's `rollout_steps` steps of its environments, flattened to [steps * envs]:
    what PPO trains on, plus the returns of the episodes that ended in it."""

    obs: torch.Tensor
    actions: torch.Tensor
    logp: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    episodes: list[float] = field(default_factory=list)


class EnvRunner(PolicyCopy):
    """One runner proc: see the module. `index` and `incarnation` pick its seeds."""

    def __init__(
        self,
        policy: str | Callable[..., Any] | None,
        algorithm: PPO,
        *,
        seed: int,
        index: int,
        incarnation: int = 0,
    ) -> None:
        self.algorithm = algorithm
        self.model = build_policy(policy, algorithm.env, seed).eval()
        own = _seed(seed, index, incarnation)
        self.envs = make_envs(algorithm.env, algorithm.envs_per_runner, own)
        self.generator = torch.Generator().manual_seed(own)
        self.obs = torch.as_tensor(self.envs.reset(seed=own)[0], dtype=torch.float32)
        self.running = np.zeros(algorithm.envs_per_runner)  # each env's episode return so far

    @endpoint
    def sample(self, keys: list[int]) -> list[Rollout]:
        """One segment per key, under the installed version."""
        return [Rollout(key=k, version=self.version, data=self._segment()) for k in keys]

    @torch.no_grad()
    def _segment(self) -> Segment:
        a, n = self.algorithm, self.algorithm.envs_per_runner
        obs, actions, logps = [], [], []
        values = torch.zeros(a.rollout_steps + 1, n)
        rewards = torch.zeros(a.rollout_steps, n)
        dones = torch.zeros(a.rollout_steps, n)
        episodes: list[float] = []
        for t in range(a.rollout_steps):
            logits, value = self.model(self.obs)
            probs = torch.softmax(logits, dim=-1)
            action = torch.multinomial(probs, 1, generator=self.generator)[:, 0]
            obs.append(self.obs)
            actions.append(action)
            logps.append(log_prob_and_entropy(logits, action)[0])
            values[t] = value
            nxt, raw, terminated, truncated, info = self.envs.step(action.numpy())
            self.running += raw
            reward = torch.as_tensor(raw, dtype=torch.float32)
            ended = np.logical_or(terminated, truncated)
            cut = np.flatnonzero(np.logical_and(truncated, ~terminated))
            if len(cut):  # cut by the time limit, not failed: what would have followed counts
                final = torch.as_tensor(np.stack(info["final_obs"][cut]), dtype=torch.float32)
                reward[cut] += a.gamma * self.model(final)[1]
            rewards[t] = reward
            dones[t] = torch.as_tensor(ended, dtype=torch.float32)
            for i in np.flatnonzero(ended):
                episodes.append(float(self.running[i]))
                self.running[i] = 0.0
            self.obs = torch.as_tensor(nxt, dtype=torch.float32)
        values[-1] = self.model(self.obs)[1]
        advantages, returns = gae(rewards, values, dones, gamma=a.gamma, lam=a.lam)
        return Segment(
            obs=torch.cat(obs),
            actions=torch.cat(actions),
            logp=torch.cat(logps),
            advantages=advantages.flatten(),
            returns=returns.flatten(),
            episodes=episodes,
        )
