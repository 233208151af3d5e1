"""The failure and grow policies' decisions (pure: no Ray, no torch)."""

from __future__ import annotations

import time

from raymesh.train.control.failure import FailurePolicy, GrowPolicy
from raymesh.train.result import FailureRecord


def _failures(n: int) -> list[FailureRecord]:
    return [FailureRecord(rank=1, step=10 * i, cause="SIGKILL", kind="died") for i in range(n)]


def test_lost_ranks_are_replaced_while_there_is_room_and_budget() -> None:
    policy = FailurePolicy(max_failures=2)
    d = policy.decide(_failures(1), 4, replacements=1, lost=1, min_workers=4)
    assert (d.action, d.world_size) == ("replace", 4)
    assert "failure 1 of max_failures=2" in d.reason


def test_without_room_an_elastic_job_shrinks_down_to_min_and_no_further() -> None:
    policy = FailurePolicy(max_failures=5)
    d = policy.decide(_failures(2), 4, replacements=0, lost=2, min_workers=2)
    assert (d.action, d.world_size) == ("shrink", 2)
    d = policy.decide(_failures(3), 4, replacements=0, lost=3, min_workers=2)
    assert d.action == "abort" and "fewer than min workers 2" in d.reason


def test_past_the_budget_the_job_aborts() -> None:
    d = FailurePolicy(max_failures=1).decide(_failures(2), 2, replacements=1, lost=1, min_workers=2)
    assert d.action == "abort" and "more than max_failures=1" in d.reason


def test_failures_older_than_the_window_do_not_count_towards_max_failures() -> None:
    now = time.time()

    def at(age: float, step: int) -> FailureRecord:
        return FailureRecord(rank=1, step=step, cause="SIGKILL", kind="died", time=now - age)

    spread = [at(300.0, 10), at(61.0, 20), at(0.0, 30)]  # the newest is the one to heal now
    policy = FailurePolicy(max_failures=1, window_s=60.0)
    d = policy.decide(spread, 2, replacements=1, lost=1, min_workers=2)
    assert d.action == "replace", d.reason
    assert "failure 1 of max_failures=1 in the last 60s" in d.reason
    # A second failure inside the window is one too many; without a window all three count.
    d = policy.decide(
        [*spread[:2], at(59.0, 25), spread[2]], 2, replacements=1, lost=1, min_workers=2
    )
    assert (
        d.action == "abort" and "2 failures in the last 60s, more than max_failures=1" in d.reason
    )
    d = FailurePolicy(max_failures=1).decide(spread, 2, replacements=1, lost=1, min_workers=2)
    assert d.action == "abort" and "3 failures, more than max_failures=1" in d.reason


def test_ranks_stuck_behind_a_failure_are_replaced_but_not_counted() -> None:
    stuck = FailureRecord(rank=0, step=10, cause="stuck in a collective", kind="stuck")
    d = FailurePolicy(max_failures=1).decide(
        [*_failures(1), stuck], 2, replacements=2, lost=2, min_workers=2
    )
    assert d.action == "replace" and "failure 1 of max_failures=1" in d.reason


def test_a_place_stuck_again_at_the_same_step_counts_so_a_world_that_cannot_form_aborts() -> None:
    # Seen for real: a replacement whose setup waited on a collective the survivors never
    # joined was stuck at every re-form, and the job replaced it for ever.
    def stuck(rank: int, step: int) -> FailureRecord:
        return FailureRecord(rank=rank, step=step, cause="stuck joining", kind="stuck")

    policy = FailurePolicy(max_failures=2)
    once = [*_failures(1), stuck(1, 3), stuck(0, 3), stuck(1, 7)]
    assert policy.decide(once, 2, replacements=1, lost=1, min_workers=2).action == "replace"
    d = policy.decide([*once, stuck(1, 3), stuck(1, 3)], 2, replacements=1, lost=1, min_workers=2)
    assert d.action == "abort" and "3 failures, more than max_failures=2" in d.reason


def test_grow_back_to_max_with_the_ranks_that_are_ready() -> None:
    policy = GrowPolicy()
    assert policy.decide(4, max_workers=4, ready=2) is None
    assert policy.decide(2, max_workers=4, ready=0) is None
    d = policy.decide(2, max_workers=4, ready=1)
    assert d is not None and (d.action, d.world_size) == ("grow", 3)
    assert "2 -> 3 (max 4)" in d.reason
