"""Load balancing on real procs: one rank made 3x slower gets a smaller share of each global
batch, and the weights still match the balanced run's (the loss is weighted by each share)."""

from __future__ import annotations

import pytest

from raymesh import train
from raymesh.testing import slow

from .weights import MLP, close

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]


def test_a_straggler_gets_fewer_samples_and_the_weights_are_unchanged(fit):
    base = dict(workers=2, steps=24, global_batch_size=48, seed=0, report_every=2)
    clean = fit(MLP, train.TrainConfig(**base))
    result = fit(
        MLP,
        train.TrainConfig(**base, rebalance=True, faults=[slow(rank=1, factor=3.0, at_step=1)]),
    )
    assert result.rebalances, "no rebalance happened"
    sizes = result.rebalances[-1]["sizes"]
    assert sum(sizes) == 48 and sizes[1] < sizes[0], result.rebalances
    assert [h["step"] for h in result.history] == list(range(1, 25))
    assert close(clean.state_dict(), result.state_dict(), rtol=1e-4, atol=1e-6)
