"""Client-level differential privacy (DP-FedAvg, McMahan et al., ICLR 2018): each update is
clipped to L2 norm `clip`, the server adds Gaussian noise of standard deviation
`noise_multiplier * clip` to their sum, and Opacus's RDP accountant reports epsilon."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = ["DP", "PrivacyAccountant", "clip_update"]


@dataclass(frozen=True, kw_only=True)
class DP:
    """`clip`: the L2 bound on one client's update; `noise_multiplier`: noise std over `clip`;
    `delta`: the delta epsilon is reported at. DP-FedAvg counts every clipped update equally
    (a sample count would leak) and divides the noisy sum by the number of clients sampled
    (raymesh.federated.run does both)."""

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


class PrivacyAccountant:
    """Epsilon spent so far, from Opacus's RDP accountant: one step per round at sampling
    rate `sample_rate` (the chance a given client is asked)."""

    def __init__(self, dp: DP) -> None:
        from opacus.accountants import RDPAccountant

        self.dp = dp
        self._acc = RDPAccountant()

    def step(self, sample_rate: float) -> float:
        self._acc.step(noise_multiplier=self.dp.noise_multiplier, sample_rate=sample_rate)
        return self.epsilon

    @property
    def epsilon(self) -> float:
        if not self._acc.history:
            return 0.0
        return float(self._acc.get_epsilon(delta=self.dp.delta))

    def noise(self, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        return rng.normal(0.0, self.dp.noise_multiplier * self.dp.clip, shape)
