"""Federated learning on non-IID synthetic data: the task of the federated benchmark's anchors
(../shared/anchors/flower_sim.py and fedavg_ray_plain.py).

Each client holds 200 private samples of a 10-class, 20-feature Gaussian mixture whose label
mix is drawn from Dirichlet(0.5); the model is an MLP 20-64-64-10 trained with SGD (lr 0.1,
batch 16), one local epoch per round; the server evaluates on a balanced 2000-sample set.

    python -m raymesh.examples.fedmlp --clients 100 --rounds 5 --secure
    raymesh federated examples/federated.toml

This module imports no Ray and no raymesh unless they are installed, so an edge device can run
`client_fn` with only torch and NumPy (`python device.py --client raymesh.examples.fedmlp:client_fn`
or a copy of this file).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import numpy as np
import torch
from torch import nn

try:  # on a device without raymesh, any object with these three fields is a client
    from raymesh.federated import Client
except ImportError:
    from types import SimpleNamespace as Client  # type: ignore[assignment]

__all__ = ["build_model", "client_data", "client_fn", "evaluate", "test_data", "train"]

FEATURES, CLASSES, PER_CLIENT, ALPHA = 20, 10, 200, 0.5
BATCH, LR, NOISE = 16, 0.1, 1.0


@lru_cache(maxsize=1)
def _centres() -> np.ndarray:
    return np.random.default_rng(0).normal(0, 1.0, (CLASSES, FEATURES)).astype("float32")


def client_data(cid: int) -> tuple[np.ndarray, np.ndarray]:
    """Client `cid`'s private shard: its own Dirichlet label mix, the same every call."""
    rng = np.random.default_rng(1000 + cid)
    p = rng.dirichlet([ALPHA] * CLASSES)
    y = rng.choice(CLASSES, PER_CLIENT, p=p)
    x = _centres()[y] + rng.normal(0, NOISE, (PER_CLIENT, FEATURES)).astype("float32")
    return x.astype("float32"), y.astype("int64")


@lru_cache(maxsize=1)
def test_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    y = rng.integers(0, CLASSES, 2000)
    x = _centres()[y] + rng.normal(0, NOISE, (2000, FEATURES)).astype("float32")
    return x.astype("float32"), y.astype("int64")


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, CLASSES)
    )


def train(model: nn.Module, data: Any, config: Mapping[str, Any]) -> dict[str, float]:
    """`local_epochs` of SGD over the shard (with FedProx's proximal term when the strategy
    sends `proximal_mu`); the shuffle is seeded by round and client, as in the anchors."""
    x, y = (torch.from_numpy(a) for a in data)
    mu = float(config.get("proximal_mu", 0.0))
    start = [p.detach().clone() for p in model.parameters()] if mu else []
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    lossf = nn.CrossEntropyLoss()
    seed = int(config.get("round", 0)) * 1000 + int(config.get("client", 0))
    total = 0.0
    for _ in range(int(config.get("local_epochs", 1))):
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
        total = 0.0
        for i in range(0, len(x), BATCH):
            idx = perm[i : i + BATCH]
            opt.zero_grad()
            loss = lossf(model(x[idx]), y[idx])
            if mu:
                loss = loss + mu / 2 * sum(
                    ((p - p0) ** 2).sum() for p, p0 in zip(model.parameters(), start, strict=True)
                )
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
    return {"num_examples": len(x), "loss": total / len(x)}


def client_fn(cid: int) -> Any:
    return Client(model=build_model(), data=client_data(cid), train_fn=train)


def evaluate(model: nn.Module) -> float:
    """Accuracy on the balanced test set."""
    x, y = test_data()
    with torch.no_grad():
        return float((model(torch.from_numpy(x)).argmax(1).numpy() == y).mean())


def main() -> None:
    from raymesh import federated as fl
    from raymesh.examples import fedmlp  # by reference, not as __main__, for the procs

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fraction", type=float, default=0.1)
    ap.add_argument("--secure", action="store_true", help="secure aggregation")
    args = ap.parse_args()
    result = fl.run(
        fedmlp.client_fn,
        fl.FedAvg(fraction=args.fraction, min_clients=2),
        clients=args.clients,
        rounds=args.rounds,
        secure_aggregation=args.secure,
        evaluate_fn=fedmlp.evaluate,
        on_round=lambda r: print(
            f"round {r.round}: {r.responded}/{r.sampled} clients, {r.seconds:.3f} s, "
            f"accuracy {r.metrics.get('accuracy', float('nan')):.3f}"
        ),
    )
    print(f"final accuracy {result.history[-1].metrics['accuracy']:.3f}")


if __name__ == "__main__":
    main()
