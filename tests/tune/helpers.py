"""Build functions for the tune tests (importable by procs)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from raymesh.train import Context, Task


class _Point(torch.nn.Module):
    """Parameters starting at the trial's point: the loss is the squared distance to a known
    optimum, constant while lr is 0."""

    def __init__(self, *coords: float) -> None:
        super().__init__()
        self.p = torch.nn.Parameter(torch.tensor([float(c) for c in coords]))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.p + 0.0 * batch.sum()


def _distance(optimum: list[float], sleep: float):
    target = torch.tensor(optimum)

    def loss(model, batch) -> torch.Tensor:
        if sleep:
            time.sleep(sleep)  # a step long enough to stop a study in the middle of a trial
        return ((model(batch) - target) ** 2).sum()

    return loss


def _task(model: _Point, ctx: Context, optimum: list[float]) -> Task:
    return Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=ctx.params.get("lr", 0.0)),
        dataset=torch.zeros(16, 1),
        loss_fn=_distance(optimum, ctx.params.get("sleep", 0.0)),
    )


def quadratic(ctx: Context) -> Task:
    """Optimum x = 0.3; x = 0.9 fails in the build, on purpose. With params["pids"] (a folder),
    each build notes the pid of the process it runs in there."""
    if "pids" in ctx.params:
        with (Path(ctx.params["pids"]) / f"{os.getpid()}-{ctx.params['x']}").open("w"):
            pass
    x = ctx.params["x"]
    if x == 0.9:
        raise ValueError("x = 0.9 is a broken configuration")
    return _task(_Point(x), ctx, [0.3])


def bowl(ctx: Context) -> Task:
    """Two parameters, optimum (x, y) = (0.3, -0.2)."""
    return _task(_Point(ctx.params["x"], ctx.params["y"]), ctx, [0.3, -0.2])


def mlp_lr(ctx: Context) -> Task:
    """The example MLP with the trial's learning rate (params["lr"]); bench/chaos.py's trials."""
    from raymesh.examples import mlp

    task = mlp.build(ctx)
    for group in task.optimizer.param_groups:
        group["lr"] = ctx.params.get("lr", group["lr"])
    return task
