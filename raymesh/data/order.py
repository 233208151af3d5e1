"""The global sample order: which dataset indices each rank reads at each step.

One order for the whole job, derived from `(seed, epoch)` alone. Step `s` (0-based) consumes the
global batch `s`: positions `[s * B, (s + 1) * B)` of the endless stream
`epoch_order(seed, 0, n) + epoch_order(seed, 1, n) + ...`. Each rank then reads its contiguous
share of that batch, split into micro batches.

Guarantees:
- Deterministic: the same `(seed, step, batch_size, n)` gives the same indices in every process,
  every run (the per-epoch seed comes from a fixed hash, never Python's salted `hash()`), for a
  given torch version (`torch.randperm` draws the permutation).
- World-size independent: `global_batch` takes no world size, so a job resumed at step `s` on any
  number of ranks trains on exactly the samples an uninterrupted run would have, in the same
  global order; only the split across ranks changes. Shares may be uneven (a world size that
  does not divide the batch, or a split rebalanced for a slow rank): the trainer weights each
  rank's loss by its share, so the gradient is the global batch's mean either way.
- Every sample once per epoch: each epoch is a permutation of `range(n)`. Batches run straight
  across epoch boundaries (no sample is dropped or repeated to pad the last batch of an epoch).
"""

from __future__ import annotations

import functools
import hashlib

import torch

from raymesh._common import check_int, is_int

__all__ = [
    "epoch_of",
    "epoch_order",
    "global_batch",
    "micro_batches",
    "rank_share",
    "split_sizes",
]


def _epoch_seed(seed: int, epoch: int) -> int:
    # A cryptographic hash mixes (seed, epoch) so that neighbouring seeds or epochs give unrelated
    # streams, and is stable across processes (Python's hash() of str is salted per process).
    # The salt keeps the module's old name: a new one would change every job's sample order.
    digest = hashlib.blake2b(f"raymesh.train.data:{seed}:{epoch}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little")  # < 2**64, what manual_seed accepts


# Consecutive steps read the same epoch (and a step that spans a boundary reads two), so a small
# cache saves redrawing a permutation per step. Tuples keep the cached value immutable.
@functools.lru_cache(maxsize=4)
def _order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    generator = torch.Generator(device="cpu")
    generator.manual_seed(_epoch_seed(seed, epoch))
    return tuple(torch.randperm(n, generator=generator).tolist())


def epoch_order(seed: int, epoch: int, n: int) -> list[int]:
    """The permutation of `range(n)` that epoch `epoch` visits, a pure function of its arguments.

    Raises ValueError if `epoch < 0` or `n < 1`.
    """
    check_int("seed", seed, minimum=None)  # any int: it is hashed
    check_int("epoch", epoch, minimum=0)
    check_int("n", n, minimum=1)
    return list(_order(seed, epoch, n))


def global_batch(seed: int, step: int, batch_size: int, n: int) -> list[int]:
    """The dataset indices that step `step` trains on, across all ranks, in order.

    These are positions `[step * batch_size, (step + 1) * batch_size)` of the concatenation of
    `epoch_order(seed, 0, n)`, `epoch_order(seed, 1, n)`, ...; a batch may span an epoch boundary
    (or several, when `batch_size > n`). There is deliberately no world-size argument: see the
    module docstring.

    Raises ValueError if `step < 0`, `batch_size < 1` or `n < 1`.
    """
    check_int("seed", seed, minimum=None)  # any int: it is hashed
    check_int("step", step, minimum=0)
    check_int("batch_size", batch_size, minimum=1)
    check_int("n", n, minimum=1)
    batch: list[int] = []
    position = step * batch_size
    end = position + batch_size
    while position < end:
        epoch, offset = divmod(position, n)
        take = min(end - position, n - offset)  # up to the end of this epoch
        batch.extend(_order(seed, epoch, n)[offset : offset + take])
        position += take
    return batch


def split_sizes(batch_size: int, world_size: int) -> list[int]:
    """How many samples of a `batch_size` batch each of `world_size` ranks reads: as even as it
    can be (the first `batch_size % world_size` ranks read one more). Raises ValueError if there
    are fewer samples than ranks."""
    check_int("batch_size", batch_size, minimum=1)
    check_int("world_size", world_size, minimum=1)
    if batch_size < world_size:
        raise ValueError(
            f"a batch of {batch_size} samples cannot give each of world_size={world_size} ranks "
            f"one; use global_batch_size >= {world_size}"
        )
    base, extra = divmod(batch_size, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def rank_share(
    batch: list[int], world_size: int, rank: int, sizes: list[int] | None = None
) -> list[int]:
    """Rank `rank`'s contiguous slice of `batch`: `sizes[rank]` samples (default: the even split
    of `split_sizes`).

    Concatenating the shares of ranks `0 .. world_size - 1` gives back `batch`, so the global
    order holds at any world size and any split. Raises ValueError if the rank is out of range
    or `sizes` does not split the batch.
    """
    check_int("world_size", world_size, minimum=1)
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r}: must be in [0, world_size={world_size})")
    if sizes is None:
        sizes = split_sizes(len(batch), world_size)
    elif len(sizes) != world_size or sum(sizes) != len(batch) or min(sizes) < 0:
        raise ValueError(
            f"sizes={sizes!r} do not split a batch of {len(batch)} samples among "
            f"world_size={world_size} ranks; give {world_size} counts summing to {len(batch)}"
        )
    begin = sum(sizes[:rank])
    return batch[begin : begin + sizes[rank]]


def micro_batches(indices: list[int], micro_batch_size: int | None) -> list[list[int]]:
    """Split a rank's share into consecutive micro batches of `micro_batch_size` indices (the
    last one smaller when the size does not divide the share).

    `None` gives exactly one micro batch, the whole share. The trainer weights each micro
    batch's loss by its share of the global batch, so gradient accumulation matches one big
    batch whatever the sizes.
    """
    if micro_batch_size is None:
        return [list(indices)]
    check_int("micro_batch_size", micro_batch_size, minimum=1)
    return [
        list(indices[i : i + micro_batch_size]) for i in range(0, len(indices), micro_batch_size)
    ]


def epoch_of(step: int, batch_size: int, n: int) -> int:
    """The epoch of the first sample that step `step` trains on (`step * batch_size // n`)."""
    check_int("step", step, minimum=0)
    check_int("batch_size", batch_size, minimum=1)
    check_int("n", n, minimum=1)
    return step * batch_size // n
