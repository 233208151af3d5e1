"""MLPs on synthetic data: fast jobs for tests, for the DDP/FSDP/HSDP choice and for benchmarks.

Three build functions, all offline and deterministic:
- `build`: a small MLP learning a fixed random teacher network (trains in seconds on CPU).
- `build_large`: the same task with a deep, wide MLP (3.2M parameters, 12.2 MiB of fp32
  weights; ~49 MiB per rank under DDP with AdamW), for exercising the FSDP choice with a small
  `memory_budget_gb`.
- `build_bench`: the training benchmark's model, 784-1024-1024-10 with SGD(lr=0.01), on
  MNIST-shaped random data (the same job as the plain-DDP and Ray Train anchors).

On a laptop:

    python -m raymesh.examples.mlp --workers 2 --steps 200
    python -m raymesh.examples.mlp --which large --workers 2 --memory-budget-gb 0.06

or from a job file with `build = "raymesh.examples.mlp:build_bench"`: `raymesh train job.toml`.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raymesh.examples import on_compute_device
from raymesh.train import Context, Task

__all__ = [
    "MLP",
    "MLP784",
    "SyntheticClassification",
    "SyntheticMNIST",
    "build",
    "build_bench",
    "build_large",
    "classification_loss",
]

LARGE_HIDDEN = 1024  # build_large: width of each hidden layer
LARGE_DEPTH = 4  # build_large: hidden layers, each one FSDP unit


class SyntheticClassification(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """n points x ~ N(0, I_dim) labelled by a fixed random teacher: argmax(W2 tanh(W1 x)).

    A function of (n, dim, classes, seed) only, drawn from its own torch.Generator (the global
    RNG is untouched), so every rank and machine sees the same data; an MLP can learn it.
    Item i = (x float32 [dim], y int64 scalar).
    """

    def __init__(self, n: int = 2048, dim: int = 32, classes: int = 4, seed: int = 0) -> None:
        if n < 1 or dim < 1 or classes < 2:
            raise ValueError(f"n={n}, dim={dim}, classes={classes}: need n, dim >= 1, classes >= 2")
        g = torch.Generator().manual_seed(seed)
        hidden = 64
        w1 = torch.randn(dim, hidden, generator=g) / dim**0.5
        w2 = torch.randn(hidden, classes, generator=g) / hidden**0.5
        self.x = torch.randn(n, dim, generator=g)
        self.y = (torch.tanh(self.x @ w1) @ w2).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class SyntheticMNIST(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """MNIST-shaped noise for throughput benchmarks: x ~ N(0, 1) [784], y = a fixed random
    label in 0..9. Deterministic given (n, seed); there is nothing to learn beyond memorising."""

    def __init__(self, n: int = 4096, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 784, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class MLP(nn.Module):
    """dim_in -> [hidden, ReLU] x depth -> classes.

    The hidden layers are `blocks`, an nn.ModuleList, so FSDP shards one layer at a time.
    """

    def __init__(self, dim_in: int, hidden: int, classes: int, depth: int = 1) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth={depth}: must be >= 1")
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim_in if i == 0 else hidden, hidden), nn.ReLU())
            for i in range(depth)
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


class MLP784(nn.Module):
    """The benchmark model: 784-1024-1024-10 with ReLUs (1,863,690 parameters)."""

    def __init__(self, hidden: int = 1024, classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(784, hidden),
            nn.ReLU(),
            nn.Linear(hidden, hidden),
            nn.ReLU(),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def classification_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean cross-entropy of `model(x)` against labels y, for a batch (x [B, dim], y [B])."""
    x, y = batch
    logits = model(on_compute_device(model, x))
    return F.cross_entropy(logits, y.to(logits.device))


def build(ctx: Context) -> Task:
    """A 32-64-4 MLP with AdamW(lr=1e-2) on 2048 teacher-labelled points."""
    dataset = SyntheticClassification()
    model = MLP(dim_in=32, hidden=64, classes=4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return Task(model=model, optimizer=optimizer, dataset=dataset, loss_fn=classification_loss)


def build_large(ctx: Context) -> Task:
    """The teacher task with a 32-1024x4-4 MLP and AdamW: 3,186,692 parameters, so about
    12.2 MiB of weights, 12.2 of grads and 24.3 of AdamW state per rank under DDP; each
    hidden layer (4 MiB) is one FSDP unit."""
    dataset = SyntheticClassification()
    model = MLP(dim_in=32, hidden=LARGE_HIDDEN, classes=4, depth=LARGE_DEPTH)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Task(model=model, optimizer=optimizer, dataset=dataset, loss_fn=classification_loss)


def build_bench(ctx: Context) -> Task:
    """The training benchmark: MLP784 with SGD(lr=0.01) on 4096 SyntheticMNIST samples."""
    model = MLP784()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return Task(
        model=model, optimizer=optimizer, dataset=SyntheticMNIST(), loss_fn=classification_loss
    )


# By name, not the functions themselves: run as a script, this module is __main__, which the
# trainer procs cannot import.
_BUILDS = {
    "small": "raymesh.examples.mlp:build",
    "large": "raymesh.examples.mlp:build_large",
    "bench": "raymesh.examples.mlp:build_bench",
}


def main(argv: list[str] | None = None) -> None:
    """Train one of the MLP jobs with raymesh and print the strategy and the loss curve."""
    from raymesh import train

    p = argparse.ArgumentParser(description="Train an MLP on synthetic data with raymesh.")
    p.add_argument("--which", default="small", choices=sorted(_BUILDS))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="global batch (samples per step)")
    p.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp", "hsdp"])
    p.add_argument("--shard-size", type=int, default=None, help="HSDP: ranks per shard group")
    p.add_argument("--memory-budget-gb", type=float, default=None)
    args = p.parse_args(argv)
    config = train.TrainConfig(
        workers=args.workers,
        steps=args.steps,
        global_batch_size=args.batch,
        strategy=args.strategy,
        shard_size=args.shard_size,
        memory_budget_gb=args.memory_budget_gb,
        report_every=10,
    )
    result = train.fit(_BUILDS[args.which], config)
    print(result.decision.reason)
    every = max(1, len(result.history) // 10)
    for i, h in enumerate(result.history):
        if h["loss"] is not None and (i % every == 0 or i == len(result.history) - 1):
            print(f"step {int(h['step']):5d}  loss {h['loss']:.4f}")


if __name__ == "__main__":
    main()
