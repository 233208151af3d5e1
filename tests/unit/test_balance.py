"""The load-balancing policy, on made-up measurements (pure: no Ray, no torch)."""

from __future__ import annotations

from raymesh.train.control.balance import BalancePolicy


def _report(policy: BalancePolicy, sizes: list[int], fixed: list[float], per: list[float]):
    """Report what ranks with time = fixed + per * samples measure at `sizes`."""
    seconds = [f + p * n for f, p, n in zip(fixed, per, sizes)]
    return policy.decide([float(n) for n in sizes], seconds, sizes)


def test_a_straggler_gets_fewer_samples_after_patience_reports() -> None:
    policy = BalancePolicy(gain=1.1, patience=2)
    per = [1e-3, 1e-3, 1e-3, 2e-3]  # rank 3 is twice as slow
    assert _report(policy, [8, 8, 8, 8], [0.0] * 4, per) is None  # one report is not enough
    decision = _report(policy, [8, 8, 8, 8], [0.0] * 4, per)
    assert decision is not None
    sizes = decision.sizes
    assert sum(sizes) == 32 and sizes[3] < min(sizes[:3])
    assert max(p * n for p, n in zip(per, sizes)) < 16e-3  # halfway to the min-max split
    assert decision.flagged == () and "predicted step" in decision.reason


def test_each_rebalance_moves_halfway_and_settles_where_times_meet() -> None:
    # Every rank pays 20 ms a step whatever its share; rank 3 is twice as slow per sample.
    fixed, per = [0.02] * 4, [1e-3, 1e-3, 1e-3, 2e-3]
    policy = BalancePolicy(gain=1.02, patience=1)
    sizes = [64, 64, 64, 64]
    for _ in range(12):
        decision = _report(policy, sizes, fixed, per)
        if decision is None:
            break
        assert sum(decision.sizes) == 256
        sizes = list(decision.sizes)
    times = [f + p * n for f, p, n in zip(fixed, per, sizes)]
    assert decision is None, "it did not settle"
    assert max(times) < 0.9 * (0.02 + 2e-3 * 64)  # faster than the even split
    assert sizes[3] >= 30, sizes  # cut, not starved by the fixed cost


def test_balanced_ranks_and_small_gains_are_left_alone() -> None:
    policy = BalancePolicy(gain=1.1, patience=1)
    assert _report(policy, [16, 16], [0.0, 0.0], [1e-3, 1e-3]) is None
    assert _report(policy, [16, 16], [0.0, 0.0], [1e-3, 1.05e-3]) is None  # below the gain
    assert policy.decide([16.0, 16.0], [0.01, 0.0], [16, 16]) is None  # no measurement yet


def test_a_noisy_report_resets_the_streak() -> None:
    # Driven by reports alone: a report with nothing to gain between two slow ones means the
    # slow ones are not in a row, so patience=2 needs two more slow reports, not one.
    policy = BalancePolicy(gain=1.1, patience=2)
    slow, even = [1e-3, 2e-3], [1e-3, 1e-3]
    assert _report(policy, [16, 16], [0.0, 0.0], slow) is None  # 1 in a row
    assert _report(policy, [16, 16], [0.0, 0.0], even) is None  # noise: the streak is 0 again
    assert _report(policy, [16, 16], [0.0, 0.0], slow) is None  # 1 in a row, not 2
    decision = _report(policy, [16, 16], [0.0, 0.0], slow)  # 2 in a row: rebalance
    assert decision is not None and decision.sizes[1] < 16, decision
    # and a report gaining less than `gain` breaks a streak just as an even one does
    assert _report(policy, [16, 16], [0.0, 0.0], slow) is None
    assert _report(policy, [16, 16], [0.0, 0.0], [1e-3, 1.05e-3]) is None  # below the gain
    assert _report(policy, [16, 16], [0.0, 0.0], slow) is None
    assert _report(policy, [16, 16], [0.0, 0.0], slow) is not None


def test_a_rank_far_slower_than_the_median_is_flagged() -> None:
    policy = BalancePolicy(gain=1.1, patience=1, flag_factor=3.0)
    decision = _report(policy, [8, 8, 8, 8], [0.0] * 4, [1e-3, 1e-3, 1e-3, 5e-3])
    assert decision is not None and decision.flagged == (3,)
    assert "rank(s) [3]" in decision.reason


def test_the_split_always_sums_to_the_global_batch() -> None:
    import random

    rng = random.Random(0)
    for _ in range(200):
        world = rng.randint(2, 8)
        batch = rng.randint(world, 300)
        sizes = [batch // world] * world
        sizes[0] += batch - sum(sizes)
        per = [rng.uniform(1e-4, 5e-3) for _ in range(world)]
        decision = BalancePolicy(gain=1.0, patience=1).decide(
            [float(n) for n in sizes], [p * n for p, n in zip(per, sizes)], sizes
        )
        if decision is not None:
            assert sum(decision.sizes) == batch and min(decision.sizes) >= 1, decision
