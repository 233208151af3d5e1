"""The global sample order (raymesh.data.order): deterministic, resumable, world-size free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from raymesh.data import order as order_module
from raymesh.data.order import (
    epoch_of,
    epoch_order,
    global_batch,
    micro_batches,
    rank_share,
    split_sizes,
)


def _fresh_cache() -> None:
    """Forget every cached permutation, so that the next call draws its order anew."""
    order_module._order.cache_clear()
    assert order_module._order.cache_info().currsize == 0


def test_the_order_is_the_same_on_every_call() -> None:
    # Each call after the first is drawn anew (the module caches permutations: comparing a
    # cached value with itself would prove nothing), once through the cache and once around it.
    _fresh_cache()
    first_order, first_batch = epoch_order(7, 3, 100), global_batch(7, 5, 16, 100)
    _fresh_cache()
    assert epoch_order(7, 3, 100) == first_order
    assert global_batch(7, 5, 16, 100) == first_batch
    assert list(order_module._order.__wrapped__(7, 3, 100)) == first_order  # no cache at all


def test_the_order_is_the_same_in_another_process() -> None:
    # Python salts str hashes per process; the order must not depend on that.
    code = "from raymesh.data.order import epoch_order; print(epoch_order(7, 3, 50))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.strip() == str(epoch_order(7, 3, 50))


def test_different_seeds_and_epochs_give_different_orders() -> None:
    assert epoch_order(0, 0, 100) != epoch_order(1, 0, 100)
    assert epoch_order(0, 0, 100) != epoch_order(0, 1, 100)


def test_the_returned_order_is_a_copy_that_callers_may_change() -> None:
    order = epoch_order(0, 0, 10)
    order.reverse()
    assert epoch_order(0, 0, 10) != order


@pytest.mark.parametrize("n", [1, 2, 17, 100])
def test_each_epoch_is_a_permutation_of_the_dataset(n: int) -> None:
    for epoch in range(3):
        assert sorted(epoch_order(3, epoch, n)) == list(range(n))


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_rank_shares_concatenated_in_rank_order_are_the_global_batch(world_size: int) -> None:
    batch = global_batch(0, 2, 8, 30)
    shares = [rank_share(batch, world_size, r) for r in range(world_size)]
    assert [i for share in shares for i in share] == batch
    assert {len(share) for share in shares} == {8 // world_size}


def test_one_epoch_of_steps_visits_every_index_exactly_once() -> None:
    n, batch_size = 24, 6
    seen = [i for step in range(n // batch_size) for i in global_batch(5, step, batch_size, n)]
    assert sorted(seen) == list(range(n))
    assert seen == epoch_order(5, 0, n)


def test_a_batch_spanning_an_epoch_boundary_ends_one_epoch_and_starts_the_next() -> None:
    n, batch_size = 10, 4
    # step 2 covers positions 8..11: the last two of epoch 0, the first two of epoch 1
    assert global_batch(1, 2, batch_size, n) == epoch_order(1, 0, n)[8:] + epoch_order(1, 1, n)[:2]
    assert epoch_of(2, batch_size, n) == 0
    assert epoch_of(3, batch_size, n) == 1


def test_a_batch_larger_than_the_dataset_spans_several_epochs() -> None:
    n = 3
    expected = epoch_order(2, 0, n) + epoch_order(2, 1, n) + epoch_order(2, 2, n)[:1]
    assert global_batch(2, 0, 7, n) == expected
    assert epoch_of(1, 7, n) == 2


def test_resuming_at_a_step_gives_the_batches_of_an_uninterrupted_run() -> None:
    n, batch_size, steps = 13, 5, 12
    _fresh_cache()
    uninterrupted = [global_batch(9, s, batch_size, n) for s in range(steps)]
    _ = [global_batch(4, s, 3, 50) for s in range(40)]  # other jobs' orders in between
    _fresh_cache()  # a resumed job starts in a new process: nothing of the first run is cached
    resumed = [global_batch(9, s, batch_size, n) for s in range(7, steps)]
    assert resumed == uninterrupted[7:]
    stream = [i for epoch in range(6) for i in epoch_order(9, epoch, n)]
    assert [i for b in uninterrupted for i in b] == stream[: steps * batch_size]


def test_the_order_is_independent_of_the_world_size() -> None:
    # global_batch takes no world size; a job resized from 4 to 2 ranks reads the same samples.
    for step in range(5):
        batch = global_batch(0, step, 8, 20)
        at_4 = [i for r in range(4) for i in rank_share(batch, 4, r)]
        at_2 = [i for r in range(2) for i in rank_share(batch, 2, r)]
        assert at_4 == at_2 == batch


def test_micro_batches_split_a_share_in_order() -> None:
    assert micro_batches([5, 6, 7, 8], 2) == [[5, 6], [7, 8]]
    assert micro_batches([5, 6, 7, 8], None) == [[5, 6, 7, 8]]
    assert micro_batches([5, 6, 7, 8], 4) == [[5, 6, 7, 8]]
    assert micro_batches([5, 6, 7, 8, 9], 2) == [[5, 6], [7, 8], [9]]


def _dealt(batch_size: int, world_size: int) -> list[int]:
    """The reference split: deal the samples out one at a time, rank 0 first, and count each
    rank's; the ranks dealt one more are the first ones."""
    return [len(range(rank, batch_size, world_size)) for rank in range(world_size)]


@pytest.mark.parametrize(
    ("batch_size", "world_size", "sizes"),
    [
        (10, 4, [3, 3, 2, 2]),  # the docstring's example
        (10, 3, [4, 3, 3]),
        (10, 7, [2, 2, 2, 1, 1, 1, 1]),
        (8, 4, [2, 2, 2, 2]),
        (5, 5, [1, 1, 1, 1, 1]),
        (7, 1, [7]),
        (11, 2, [6, 5]),
    ],
)
def test_the_first_ranks_read_one_more_when_the_world_does_not_divide_the_batch(
    batch_size: int, world_size: int, sizes: list[int]
) -> None:
    assert split_sizes(batch_size, world_size) == sizes == _dealt(batch_size, world_size)


def test_the_split_is_the_dealt_split_for_every_small_batch_and_world() -> None:
    for world_size in range(1, 9):
        for batch_size in range(world_size, 40):
            assert split_sizes(batch_size, world_size) == _dealt(batch_size, world_size)


def test_uneven_shares_still_concatenate_to_the_global_batch() -> None:
    batch = global_batch(0, 3, 10, 50)
    for world_size in (3, 4, 7):
        sizes = _dealt(10, world_size)
        shares = [rank_share(batch, world_size, r) for r in range(world_size)]
        assert [len(s) for s in shares] == sizes
        assert [i for s in shares for i in s] == batch
        begins = [sum(sizes[:r]) for r in range(world_size)]
        assert shares == [batch[b : b + n] for b, n in zip(begins, sizes)]
