"""What the RL controller reads and decides without Ray: the loop's position in its samples as a
checkpoint's manifest holds it (a hostile one refused before it is expanded), a step whose
completions were all dropped, and `raymesh rl`'s line for a step that dropped most."""

from __future__ import annotations

import math

import pytest
import torch

from raymesh import rl
from raymesh.cli.rl import progress_line
from raymesh.rl.loop import Loop
from raymesh.rl.sampling import Completions, check_scored


def _loop(per_step: int = 4, max_staleness: int = 1) -> Loop:
    def no_workers(index: int) -> object:
        raise AssertionError("restoring a position starts no worker")

    return Loop(lambda keys: keys, per_step, max_staleness, 10.0, no_workers)  # type: ignore[arg-type]


def test_a_position_taken_out_of_order_restores_the_keys_not_taken_first():
    loop = _loop()
    loop.taken.took([0, 1, 2, 4, 7])  # 3, 5 and 6 were still being made when 4 and 7 were taken
    saved = loop.position()
    assert saved == {"taken_below": 3, "taken": [4, 7]}
    again = _loop()
    again.restore(saved)
    assert list(again.todo) == [3, 5, 6] and again.next_key == 8
    assert again.position() == saved
    fresh = _loop()
    fresh.restore({})  # a checkpoint saved before positions were: a fresh start
    assert list(fresh.todo) == [] and fresh.next_key == 0


@pytest.mark.timeout(30)  # the old restore expanded a hostile span: it ran out of memory
@pytest.mark.parametrize(
    ("position", "message"),
    [
        # a trillion keys to make again, had it been expanded
        ({"taken_below": 0, "taken": [10**12]}, r"^extra\.rl\.taken=\[1000000000000\]: holds"),
        ({"taken_below": 0, "taken": list(range(1, 200_001))}, r"^extra\.rl\.taken='<list of"),
        ({"taken_below": 2**70, "taken": []}, r"^extra\.rl\.taken_below=1180591620717411303424"),
        ({"taken_below": -1}, r"^extra\.rl\.taken_below=-1: give an integer 0\.\."),
        ({"taken_below": "3"}, r"^extra\.rl\.taken_below='3'"),
        ({"taken_below": True}, r"^extra\.rl\.taken_below=True"),
        ({"taken_below": 5, "taken": [5]}, r"^extra\.rl\.taken=\[5\]: holds 5: give keys above"),
        ({"taken_below": 5, "taken": [7, 7]}, r"^extra\.rl\.taken=\[7, 7\]: give each key once"),
        ({"taken_below": 0, "taken": [1.5]}, r"^extra\.rl\.taken=\[1\.5\]: holds 1\.5"),
        ({"taken_below": 0, "taken": {"1": 2}}, r"^extra\.rl\.taken=\{'1': 2\}: give a list"),
        ([1, 2], r"^extra\.rl=\[1, 2\]: a position is a table"),
    ],
)
def test_a_hostile_position_is_refused_naming_the_field_before_anything_is_expanded(
    position, message
):
    loop = _loop()
    with pytest.raises(ValueError, match=message):
        loop.restore(position)
    assert list(loop.todo) == [] and loop.position() == {"taken_below": 0, "taken": []}


def _rollout(key: int, rewards: list[float], dropped: dict[int, str]) -> rl.Rollout:
    tokens = torch.zeros(len(rewards), 2, dtype=torch.long)
    data = Completions(b"p", tokens, torch.zeros(len(rewards), 2), torch.tensor(rewards), dropped)
    return rl.Rollout(key=key, version=0, data=data)


def test_a_step_with_no_completion_scored_is_a_reward_error_naming_the_reward_and_first_reason():
    nan = math.nan
    batch = [
        _rollout(6, [nan, nan], {0: "the reward raised KeyError: 6", 1: "later"}),
        _rollout(5, [nan, nan], {1: "the reward returned str 'x', not a number", 0: "first"}),
    ]
    with pytest.raises(rl.RewardError) as caught:
        check_scored(batch, 2, "tests.rl.rewards:es")
    error = caught.value
    assert error.reward == "tests.rl.rewards:es" and error.step == 3
    assert error.reason == "key 5 completion 0: first"
    assert str(error).startswith(
        "rl.run: no completion of step 3 could be scored by the reward tests.rl.rewards:es "
        "(all 4 dropped); the first: key 5 completion 0: first."
    )
    # One scored completion anywhere in the step is enough to learn from.
    check_scored([*batch, _rollout(7, [nan, 0.5], {0: "x"})], 2, "r")


def test_the_progress_line_counts_the_dropped_and_says_when_most_were():
    stats = {
        "version": 2.0, "reward_mean": 0.5, "staleness_mean": 0.0, "loss": 0.1,
        "clip_fraction": 0.0, "samples": 30.0, "dropped": 2.0, "step_s": 1.0, "sync_s": 0.01,
    }  # fmt: skip
    line = progress_line(stats, 4)
    assert "samples 30 dropped 2 took" in line and "MOST DROPPED" not in line, line
    line = progress_line({**stats, "samples": 12.0, "dropped": 20.0}, 4)
    assert line.startswith("step 2/4 ") and "samples 12 dropped 20" in line, line
    assert "MOST DROPPED: 20 of 32 completions had no reward" in line, line
