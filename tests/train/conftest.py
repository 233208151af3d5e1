"""Fixtures of the training tests."""

from __future__ import annotations

import functools

import pytest

from raymesh import train


@pytest.fixture(scope="module")
def fit():
    """`train.fit`, with each job of the module in procs that earlier jobs of it trained in
    (`train.WarmRanks`): the guarantees hold in reused procs as in new ones (two runs with one
    seed are bitwise equal though the second runs where the first one did, a healed job ends
    with the weights of a clean run that ran elsewhere), and the module starts few procs."""
    with train.WarmRanks() as warm:
        yield functools.partial(train.fit, warm=warm)
