"""`rl.run` end to end on real procs: it learns, and a run with the same seed whose generator
was SIGKILLed mid-rollout (replaced, its keys made again once) ends with bitwise-equal weights."""

from __future__ import annotations

import functools

import pytest
import torch

from raymesh import rl
from tests.rl import rewards

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]

PROMPTS = ["def ", "x = ", "import ", "class "]
ALGORITHM = rl.GRPO(group_size=8, max_tokens=8)


def _run(reward, steps: int = 6, **kw):  # type: ignore[no-untyped-def]
    return rl.run(
        policy="tests.rl.rewards:build",
        prompts=PROMPTS,
        reward=reward,
        algorithm=ALGORITHM,
        steps=steps,
        prompts_per_step=4,
        generators=2,
        seed=3,
        timeout_s=120,
        **kw,
    )


def test_a_synchronous_run_learns_and_ends_the_same_after_a_generator_sigkill(tmp_path):
    clean = _run(rewards.es)
    rewards_by_step = [row["reward_mean"] for row in clean.history]
    assert clean.version == 6 and len(clean.history) == 6
    assert all(row["staleness_mean"] == 0 and row["samples"] == 32 for row in clean.history)
    assert sum(rewards_by_step[-3:]) > sum(rewards_by_step[:3]), rewards_by_step  # it learns
    # Another run with the seed, whose generator dies mid-rollout: the same weights, so a run
    # is a function of its seed (with max_staleness=0) and the fault changed nothing.
    killed = _run(functools.partial(rewards.es_or_die, flag=str(tmp_path / "killed")))
    assert (tmp_path / "killed").exists() and killed.replaced == 1
    assert killed.remade and len(killed.remade) <= 2  # the dead generator's keys, made again
    assert [r["samples"] for r in killed.history] == [32] * 6  # none lost, none twice
    differ = [k for k, v in clean.weights.items() if not torch.equal(killed.weights[k], v)]
    assert differ == [], differ


def test_bad_arguments_are_refused_before_any_proc_starts():
    with pytest.raises(ValueError, match=r"^prompts=.*give a non-empty list"):
        rl.run(policy="tests.rl.rewards:build", prompts=[], reward=rewards.es, steps=1)
    with pytest.raises(ValueError, match=r"^max_staleness=-1"):
        _run(rewards.es, max_staleness=-1)
    with pytest.raises(ValueError, match=r"^reward='tests\.rl\.rewards:nope'"):
        _run("tests.rl.rewards:nope")
