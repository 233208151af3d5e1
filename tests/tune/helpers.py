"""Build functions for the tune tests (importable by procs)."""

from __future__ import annotations

import torch

from raymesh.train import Context, Task


class _Point(torch.nn.Module):
    """One parameter, starting at the trial's x: the loss is (x - 0.3)^2 while lr is 0."""

    def __init__(self, x: float) -> None:
        super().__init__()
        self.x = torch.nn.Parameter(torch.tensor([float(x)]))

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return self.x + 0.0 * batch.sum()


def _loss(model, batch) -> torch.Tensor:
    return ((model(batch) - 0.3) ** 2).sum()


def quadratic(ctx: Context) -> Task:
    """A problem whose optimum is known: x = 0.3. x = 0.9 fails in the build, on purpose."""
    x = ctx.params["x"]
    if x == 0.9:
        raise ValueError("x = 0.9 is a broken configuration")
    model = _Point(x)
    return Task(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=ctx.params.get("lr", 0.0)),
        dataset=torch.zeros(16, 1),
        loss_fn=_loss,
    )
