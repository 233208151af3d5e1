"""Sources, transforms and build functions for the pipeline tests (importable by procs)."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch

from raymesh.actor import current_actor_name
from raymesh.examples.mlp import MLP, SyntheticClassification, classification_loss
from raymesh.train import Context, Task


class Indexed(torch.utils.data.Dataset):
    """Sample i is (tensor [i, i], i): a batch says which samples it holds."""

    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return torch.tensor([float(i), float(i)]), i


def augment(sample):
    """Random, from every generator the pipeline seeds: torch, random and NumPy."""
    x, y = sample
    noise = torch.randn(x.shape) * 0.1 + random.random() * 0.01 + float(np.random.rand()) * 0.01
    return x + noise, y


def slow(sample):
    time.sleep(0.02)
    return sample


def pause(sample):
    """The sample as it is, a millisecond later: a deterministic transform with a cost."""
    time.sleep(0.001)
    return sample


def fails_on_seven(sample):
    if int(sample[1]) == 7:
        raise ValueError("sample seven is broken")
    return sample


class RecordPid:
    """`augment`, slowed a little, that notes each preprocessing proc it runs in (a file per
    pid in `folder`): the test SIGKILLs one of them. With `until` (a file's path), each
    sample takes 10x longer until that file exists, wherever it is made: a job cannot end
    before the test has seen what it waits for (a worker up, killed, and replaced), however
    slowly the machine starts procs. Its values never depend on either."""

    def __init__(self, folder: str, until: str | None = None) -> None:
        self.folder = folder
        self.until = until

    def __call__(self, sample):
        if "preprocess" in current_actor_name():
            open(os.path.join(self.folder, str(os.getpid())), "a").close()
        time.sleep(0.003 if self.until is None or os.path.exists(self.until) else 0.03)
        return augment(sample)


def build(ctx: Context) -> Task:
    """The teacher MLP with its dataset in the task (no pipeline)."""
    model = MLP(dim_in=32, hidden=64, classes=4)
    return Task(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        dataset=SyntheticClassification(n=200),
        loss_fn=classification_loss,
    )


def build_without_data(ctx: Context) -> Task:
    """The same model and optimizer; the samples come from TrainConfig.data."""
    model = MLP(dim_in=32, hidden=64, classes=4)
    return Task(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
        loss_fn=classification_loss,
    )


def teacher() -> SyntheticClassification:
    return SyntheticClassification(n=200)


def build_indexed(ctx: Context) -> Task:
    """A tiny classifier of `Indexed` samples (class = the sample's index)."""
    model = MLP(dim_in=2, hidden=8, classes=64)
    return Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1e-2),
        loss_fn=classification_loss,
    )
