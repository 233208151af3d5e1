"""A federated client: a model, the data that never leaves it, and how it trains.

This module needs only torch and NumPy (no Ray, no raymesh), so that the edge client
(raymesh.federated.edge.device) can run it on a device with nothing else installed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = ["Client", "Layout", "TrainFn", "train_locally"]

# train_fn(model, data, config) -> the number of examples trained on, or a dict holding
# "num_examples" and any other figures (a "loss" is shown per round).
TrainFn = Callable[[nn.Module, Any, Mapping[str, Any]], "int | Mapping[str, Any]"]


@dataclass
class Client:
    """What `client_fn(cid)` returns. `train_fn(model, data, config)` trains `model` in place
    on `data` and returns the number of examples it used (the weight of this client's update),
    or a dict with "num_examples" and other figures. `config` holds the strategy's settings
    ("local_epochs", "proximal_mu" for FedProx, ...), "round" and "client".

    `client_fn` must build the same client for the same cid each time it is called: raymesh
    keeps clients as state on a few procs and may build one again."""

    model: nn.Module
    data: Any
    train_fn: TrainFn


@dataclass(frozen=True)
class Layout:
    """The order, shapes and dtypes of a model's floating-point tensors, so that weights and
    updates travel as one flat float32 vector. Integer buffers (BatchNorm's counters) stay
    with each client."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, state: Mapping[str, Any]) -> Layout:
        names = tuple(k for k, v in state.items() if _floating(v))
        return cls(names, tuple(tuple(np.shape(state[k])) for k in names))

    @property
    def size(self) -> int:
        return sum(int(np.prod(s, dtype=np.int64)) for s in self.shapes)

    def flatten(self, state: Mapping[str, Any]) -> np.ndarray:
        parts = [np.asarray(_numpy(state[k]), dtype=np.float32).ravel() for k in self.names]
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        out, at = {}, 0
        for name, shape in zip(self.names, self.shapes, strict=True):
            n = int(np.prod(shape, dtype=np.int64))
            out[name] = flat[at : at + n].reshape(shape)
            at += n
        return out


def _floating(v: Any) -> bool:
    if isinstance(v, torch.Tensor):
        return v.is_floating_point()
    return np.issubdtype(np.asarray(v).dtype, np.floating)


def _numpy(v: Any) -> np.ndarray:
    return v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)


def train_locally(
    client: Any, layout: Layout, weights: np.ndarray, config: Mapping[str, Any]
) -> tuple[np.ndarray, int, dict[str, float]]:
    """Loads the global `weights` into the client's model, runs its `train_fn`, and returns
    (its weights minus the global ones as float32, the examples it used, its figures).
    Raises ValueError for an update that is not finite or a count that is not a positive
    integer, so that a bad client is dropped from its round, not averaged in."""
    model: nn.Module = client.model
    state = model.state_dict()
    for name, value in layout.unflatten(weights).items():
        state[name].copy_(torch.from_numpy(value))
    out = client.train_fn(model, client.data, config)
    figures = dict(out) if isinstance(out, Mapping) else {"num_examples": out}
    n = figures.pop("num_examples", None)
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0:
        raise ValueError(
            f"train_fn returned num_examples={n!r}: return the number of examples trained "
            "on (an int > 0), or a dict holding it"
        )
    delta = layout.flatten(model.state_dict()) - weights
    if not np.all(np.isfinite(delta)):
        raise ValueError("the update holds NaN or Inf values")
    return delta, int(n), {k: float(v) for k, v in figures.items()}
