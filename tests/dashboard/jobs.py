"""Training jobs for the dashboard's browser test, importable by the trainer procs."""

from __future__ import annotations

import time

from raymesh.examples import mlp
from raymesh.train import Context, Task


def slow_mlp(ctx: Context) -> Task:
    """raymesh.examples.mlp's job with each step made `ctx.params["sleep_s"]` longer, so that
    a browser watches it run."""
    task = mlp.build(ctx)
    sleep_s = float(ctx.params.get("sleep_s", 0.02))
    loss_fn = task.loss_fn

    def slow_loss(model, batch):
        time.sleep(sleep_s)
        return loss_fn(model, batch)

    task.loss_fn = slow_loss
    return task
