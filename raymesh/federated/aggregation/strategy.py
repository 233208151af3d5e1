"""Strategies: how clients are sampled each round and how their updates become the next
global model. A strategy is a small object over plain arrays; write a new one by subclassing
`Strategy` and overriding `apply` (the server's step), `aggregate` (to weigh updates
differently) or `client_config` (to send clients settings)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from raymesh._common import bad, check_int

__all__ = ["FedAdam", "FedAvg", "FedProx", "FedYogi", "Strategy", "Update"]

Weights = dict[str, np.ndarray]


@dataclass(frozen=True)
class Update:
    """One client's contribution: its weights minus the round's global weights, and how many
    examples it trained on (the weight of its update in the mean)."""

    client: int
    delta: Weights
    num_examples: int


@dataclass(kw_only=True)
class Strategy:
    """Samples `fraction` of the clients each round (at least `min_clients`) and applies the
    example-weighted mean of their deltas. Subclasses change `apply`, the server's step."""

    fraction: float = 0.1
    min_clients: int = 2
    local_epochs: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise bad("fraction", self.fraction, "give the share of clients per round, in (0, 1]")
        check_int("min_clients", self.min_clients, 1)
        check_int("local_epochs", self.local_epochs, 1)

    def sample(self, round_: int, clients: Sequence[int], seed: int = 0) -> list[int]:
        """The clients asked to train in `round_`: the same for the same round and seed."""
        k = min(len(clients), max(self.min_clients, round(self.fraction * len(clients))))
        rng = np.random.default_rng([seed, round_])
        return sorted(rng.choice(np.asarray(clients), k, replace=False).tolist())

    def client_config(self, round_: int) -> dict[str, object]:
        """Settings sent to every sampled client with the weights."""
        return {"local_epochs": self.local_epochs}

    @staticmethod
    def mean_delta(updates: Sequence[Update]) -> Weights:
        total = sum(u.num_examples for u in updates)
        if total <= 0:
            raise ValueError("no examples in this round's updates: nothing to average")
        out: Weights = {}
        for k in updates[0].delta:
            acc = np.zeros(updates[0].delta[k].shape, dtype=np.float64)
            for u in updates:
                acc += u.delta[k] * (u.num_examples / total)
            out[k] = acc
        return out

    def aggregate(self, weights: Mapping[str, np.ndarray], updates: Sequence[Update]) -> Weights:
        return self.apply(weights, self.mean_delta(updates))

    def apply(self, weights: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> Weights:
        """The server's step from the round's mean delta (FedAvg: add it)."""
        return {k: (w + delta[k]).astype(w.dtype) for k, w in weights.items()}


@dataclass(kw_only=True)
class FedAvg(Strategy):
    """McMahan et al. (2017): the next global model is the example-weighted mean of the
    clients' models."""


@dataclass(kw_only=True)
class FedProx(Strategy):
    """Li et al. (2020): FedAvg whose clients add `mu / 2 * ||w - w_global||^2` to their loss,
    which keeps heterogeneous clients near the global model. Clients read `mu` from
    `client_config`."""

    mu: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.mu >= 0:
            raise bad("mu", self.mu, "give the proximal weight, >= 0")

    def client_config(self, round_: int) -> dict[str, object]:
        return {**super().client_config(round_), "proximal_mu": self.mu}


@dataclass(kw_only=True)
class FedAdam(Strategy):
    """Reddi et al., "Adaptive Federated Optimization" (2021): the mean delta is a
    pseudo-gradient for an Adam step on the server."""

    server_lr: float = 0.01
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    _m: Weights = field(default_factory=dict, init=False, repr=False)
    _v: Weights = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise bad(name, getattr(self, name), "give a decay in [0, 1)")
        for name in ("server_lr", "tau"):
            if not getattr(self, name) > 0:
                raise bad(name, getattr(self, name), "give a value > 0")

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return self.beta2 * v + (1 - self.beta2) * d2

    def apply(self, weights: Mapping[str, np.ndarray], delta: Mapping[str, np.ndarray]) -> Weights:
        out = {}
        for k, w in weights.items():
            d = delta[k]
            m = self._m.get(k, np.zeros_like(d))
            v = self._v.get(k, np.full_like(d, self.tau**2))
            self._m[k] = m = self.beta1 * m + (1 - self.beta1) * d
            self._v[k] = v = self._second_moment(v, d * d)
            out[k] = (w + self.server_lr * m / (np.sqrt(v) + self.tau)).astype(w.dtype)
        return out


@dataclass(kw_only=True)
class FedYogi(FedAdam):
    """Reddi et al. (2021): FedAdam with Yogi's additive second moment, which grows more
    slowly when pseudo-gradients are large."""

    def _second_moment(self, v: np.ndarray, d2: np.ndarray) -> np.ndarray:
        return v - (1 - self.beta2) * d2 * np.sign(v - d2)
