"""Clients for the federated tests (importable by the client procs): the benchmark's task,
with clients that fail on purpose."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from raymesh.examples import fedmlp
from raymesh.federated import Client
from raymesh.federated.client import Layout

RAISES, NAN, KILLS, HANGS = 3, 5, 6, 1  # the cids that misbehave


def _raises(model: Any, data: Any, config: Mapping[str, Any]) -> int:
    raise RuntimeError("this client's data loader broke")


def _nan(model: Any, data: Any, config: Mapping[str, Any]) -> int:
    fedmlp.train(model, data, config)
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] = float("nan")
    return len(data[1])


def _kills(model: Any, data: Any, config: Mapping[str, Any]) -> Any:
    if config["round"] == 2:  # the proc hosting this client dies mid-round (a real SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    return fedmlp.train(model, data, config)


def faulty(cid: int) -> Client:
    """fedmlp's clients, except that RAISES raises and NAN sends NaN."""
    client = fedmlp.client_fn(cid)
    train = {RAISES: _raises, NAN: _nan}.get(cid, fedmlp.train)
    return Client(model=client.model, data=client.data, train_fn=train)


def _hangs(model: Any, data: Any, config: Mapping[str, Any]) -> Any:
    if config["round"] == 1:  # stuck far past the round's timeout
        time.sleep(120)
    return fedmlp.train(model, data, config)


def hanger(cid: int) -> Client:
    """fedmlp's clients, except that HANGS hangs in round 1."""
    client = fedmlp.client_fn(cid)
    train = _hangs if cid == HANGS else fedmlp.train
    return Client(model=client.model, data=client.data, train_fn=train)


def killer(cid: int) -> Client:
    """fedmlp's clients, except that KILLS SIGKILLs its proc in round 2."""
    client = fedmlp.client_fn(cid)
    train = _kills if cid == KILLS else fedmlp.train
    return Client(model=client.model, data=client.data, train_fn=train)


def by_hand(cids: list[int], round_: int = 1) -> np.ndarray:
    """Round `round_` of FedAvg over `cids` from fedmlp's initial model, computed here: the
    example-weighted mean of each client's weights after its local training."""
    model = fedmlp.build_model()
    layout = Layout.of(model.state_dict())
    start = layout.flatten(model.state_dict())
    total, n_total = np.zeros_like(start, dtype=np.float64), 0
    for c in cids:
        client = fedmlp.client_fn(c)
        out = client.train_fn(client.model, client.data, {"round": round_, "client": c})
        total += out["num_examples"] * layout.flatten(client.model.state_dict()).astype(np.float64)
        n_total += out["num_examples"]
    return total / n_total
