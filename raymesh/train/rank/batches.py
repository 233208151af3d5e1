"""This rank's samples of each step, and loading them.

The samples of step s are a pure function of (seed, s) (`raymesh.data.order`), split across the
ranks in rank order (`sizes` samples each; None: the even split), then into micro-batches: a
healed or resumed rank trains exactly the samples an uninterrupted run's rank would. They are
read from the task's dataset, or (with a pipeline, `TrainConfig.data`) taken from its workers,
made ahead (`raymesh.data.feed`). In a driven job (`train.drive`) the loop that drives it
supplies each step's samples, in their order: step s's global batch is those samples, split
the same way; given as columns (a dict of tensors whose rows are the samples), a batch is
their rows, taken at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import default_collate

from raymesh.data import order as data_order
from raymesh.data.feed import Feed
from raymesh.train.rank.step import to_device
from raymesh.train.sections import LoopConfig

__all__ = ["Batches"]


class Batches:
    """The samples of a job's steps for one rank, over a dataset of `n` samples (see the
    module docstring). `read` loads samples by index; `feed`, when given, is asked instead;
    `supplied`, when given, holds each step's samples (a driven job), collated by `collate`."""

    def __init__(
        self,
        config: LoopConfig,
        *,
        n: int,
        read: Callable[[Any], Any] | None,
        feed: Feed | None,
        device: torch.device,
        supplied: Mapping[int, Sequence[Any] | dict[str, torch.Tensor]] | None = None,
        collate: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.config = config
        self.n = n
        self.read = read
        self.feed = feed
        self.device = device
        self.supplied = supplied
        self.collate = collate
        self.current = 0  # the step being trained (0-based), whose batches `load` loads

    def micro(
        self, step: int, rank: int, world_size: int, sizes: list[int] | None
    ) -> list[list[int]]:
        """The micro-batches (sample indices) `rank` of `world_size` trains at `step`."""
        cfg = self.config
        if self.supplied is not None:
            batch = list(range(cfg.global_batch_size))  # the loop's samples, in its order
        else:
            batch = data_order.global_batch(cfg.seed, step, cfg.global_batch_size, self.n)
        mine = data_order.rank_share(batch, world_size, rank, sizes)
        return data_order.micro_batches(mine, cfg.micro_batch_size)

    def start(self, step: int, rank: int, world_size: int, sizes: list[int] | None) -> None:
        """`step` is being trained now: with a pipeline, ask for its batches and the next
        ones' (as many steps ahead as it prefetches)."""
        self.current = step
        if self.feed is not None:
            ahead = range(step, min(step + self.feed.pipe.prefetch, self.config.steps))
            self.feed.ahead(
                (s, tuple(m)) for s in ahead for m in self.micro(s, rank, world_size, sizes)
            )

    def load(self, indices: Any) -> Any:
        """The batch of samples `indices` of the current step, on the rank's device."""
        if self.feed is not None:
            return to_device(self.feed.get(self.current, indices), self.device)
        if self.supplied is not None:
            samples = self.supplied[self.current]
            if isinstance(samples, dict):  # columns
                rows = torch.as_tensor(list(indices), dtype=torch.long)
                return to_device({k: v[rows] for k, v in samples.items()}, self.device)
            collate = self.collate or default_collate
            return to_device(collate([samples[i] for i in indices]), self.device)
        assert self.read is not None
        return to_device(self.read(indices), self.device)
