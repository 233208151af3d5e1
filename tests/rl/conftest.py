"""The rl tests' shared fixture: where a fault lands, drawn from a seed the failure names."""

from __future__ import annotations

import os
import random

import pytest


class Kills(random.Random):
    """A random source for kill points, seeded `seed` (RAYMESH_TEST_SEED, or drawn): its str
    names the seed, for a failure message, so a failing kill point can be replayed."""

    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.seed_value = seed

    def __repr__(self) -> str:
        return f"kill points seeded {self.seed_value} (RAYMESH_TEST_SEED={self.seed_value})"


@pytest.fixture
def kills() -> Kills:
    """Each test's kill points come from this; the seed is printed too (pytest shows it with a
    failure's captured output)."""
    seed = os.environ.get("RAYMESH_TEST_SEED")
    rng = Kills(int(seed) if seed else random.SystemRandom().randrange(2**32))
    print(rng)
    return rng
