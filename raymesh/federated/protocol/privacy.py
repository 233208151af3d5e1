"""Client-level differential privacy (DP-FedAvg, McMahan et al., ICLR 2018): each client is
sampled independently with probability q (Poisson sampling), each update is clipped to L2 norm
`clip`, the server adds Gaussian noise of standard deviation `noise_multiplier * clip` to their
sum and divides by the expected number sampled, and Opacus's RDP accountant, whose analysis
assumes exactly that sampling, reports epsilon.

The sampling and the noise draw from the operating system's entropy, never from the run's seed:
noise anyone can regenerate protects nothing. Tests that need the same draws twice set
`_TEST_SEED` (a module attribute, in no signature), which logs a warning whenever it is used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["DP", "PrivacyAccountant", "clip_update", "poisson_sample", "private_rng"]

logger = logging.getLogger("raymesh.federated")

_TEST_SEED: int | None = None  # tests only: seeds private_rng (see the module docstring)


@dataclass(frozen=True, kw_only=True)
class DP:
    """`clip`: the L2 bound on one client's update; `noise_multiplier`: noise std over `clip`;
    `delta`: the delta epsilon is reported at. DP-FedAvg counts every clipped update equally
    (a sample count would leak) and divides the noisy sum by the expected number of clients
    sampled, the strategy's fraction times the population, whoever answered (a divisor that
    depended on who answered would leak it); raymesh.federated.run does both, samples clients
    by Poisson sampling at the strategy's fraction, and clips edge clients' updates itself when
    it sees them (without secure aggregation)."""

    clip: float = 1.0
    noise_multiplier: float = 1.0
    delta: float = 1e-5

    def __post_init__(self) -> None:
        if not self.clip > 0:
            raise ValueError(f"clip={self.clip!r}: give the L2 bound on one update, > 0")
        if not self.noise_multiplier >= 0:
            raise ValueError(f"noise_multiplier={self.noise_multiplier!r}: give a value >= 0")
        if not 0 < self.delta < 1:
            raise ValueError(f"delta={self.delta!r}: give a probability in (0, 1), e.g. 1e-5")


def clip_update(delta: Mapping[str, np.ndarray], clip: float) -> dict[str, np.ndarray]:
    """Scales `delta` so its L2 norm over all tensors is at most `clip`."""
    norm = float(
        np.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in delta.values()))
    )
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    return {k: v * scale for k, v in delta.items()}


def private_rng() -> np.random.Generator:
    """A generator seeded from the operating system's entropy (os.urandom), for what privacy
    rests on: which clients a round samples and the noise it adds."""
    if _TEST_SEED is not None:
        logger.warning("raymesh.federated: DP draws are seeded for a test: they protect nothing")
        return np.random.default_rng(_TEST_SEED)
    return np.random.default_rng(int.from_bytes(os.urandom(32), "little"))


def poisson_sample(clients: Sequence[int], rate: float, rng: np.random.Generator) -> list[int]:
    """Each client independently with probability `rate` (so the count varies round to round):
    the sampling Opacus's RDP accountant analyses."""
    if not 0 < rate <= 1:
        raise ValueError(f"rate={rate!r}: give a sampling probability in (0, 1]")
    picked = rng.random(len(clients)) < rate
    return [c for c, p in zip(clients, picked, strict=True) if p]


class PrivacyAccountant:
    """Epsilon spent so far, from Opacus's RDP accountant: one step per round at sampling
    rate `sample_rate` (the chance a given client is asked), with rounds sampled by `sample`
    (Poisson) and noised by `noise`, both from `private_rng()`."""

    def __init__(self, dp: DP) -> None:
        from opacus.accountants import RDPAccountant

        self.dp = dp
        self._acc = RDPAccountant()
        self._rng = private_rng()

    def sample(self, clients: Sequence[int], rate: float) -> list[int]:
        """This round's clients, Poisson-sampled at `rate`; step with the same rate."""
        return poisson_sample(clients, rate, self._rng)

    def step(self, sample_rate: float) -> float:
        self._acc.step(noise_multiplier=self.dp.noise_multiplier, sample_rate=sample_rate)
        return self.epsilon

    @property
    def epsilon(self) -> float:
        if not self._acc.history:
            return 0.0
        return float(self._acc.get_epsilon(delta=self.dp.delta))

    def noise(self, shape: tuple[int, ...]) -> np.ndarray:
        """Gaussian noise of std `noise_multiplier * clip`, to add to a sum of clipped updates."""
        return self._rng.normal(0.0, self.dp.noise_multiplier * self.dp.clip, shape)
