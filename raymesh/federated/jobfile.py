"""A federated run as a TOML job file (`raymesh federated job.toml`):

client_fn = "raymesh.examples.fedmlp:client_fn"   # cid -> Client
evaluate_fn = "raymesh.examples.fedmlp:evaluate"  # model -> accuracy (optional)
clients = 100
rounds = 5
secure_aggregation = true
hosts = 2                          # RunConfig's other fields, all optional

[strategy]
name = "fedavg"                    # "fedprox", "fedadam" or "fedyogi"
fraction = 0.1                     # the strategy's fields
min_clients = 8

[dp]                               # optional: client-level differential privacy
clip = 1.0
noise_multiplier = 0.8
delta = 1e-5

[edge]                             # optional: accept edge clients (EdgeConfig's fields)
port = 8765
wait_for = 4

[edge.tls]                         # optional: serve edge clients over HTTPS (paths
cert = "server.pem"                # relative to this file's folder)
key = "server-key.pem"
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from raymesh._common import Tls, from_table, read_toml, resolve
from raymesh.federated.aggregation.strategy import FedAdam, FedAvg, FedProx, FedYogi, Strategy
from raymesh.federated.config import EdgeConfig
from raymesh.federated.federation import RunConfig
from raymesh.federated.protocol.privacy import DP

__all__ = ["STRATEGIES", "FederatedJob", "load_job"]

STRATEGIES: dict[str, type[Strategy]] = {
    "fedavg": FedAvg,
    "fedprox": FedProx,
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
}


@dataclasses.dataclass(frozen=True)
class FederatedJob:
    client_fn: Any
    evaluate_fn: Any
    strategy: Strategy
    config: RunConfig


def _build(path: Path, table: str | None, cls: type, data: Any) -> Any:
    try:
        return from_table(cls, data, table)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load_job(path: str | Path, *, tls: Tls | None = None, **overrides: Any) -> FederatedJob:
    """The job's functions, strategy and RunConfig, with `overrides` (None skipped) on top of
    the file's top-level keys and `tls` (when given) on its [edge]. Raises ValueError naming
    the file and the field."""
    path = Path(path)
    data = read_toml(path)
    if "client_fn" not in data:
        raise ValueError(f'{path}: set client_fn = "module:function" (cid -> Client)')
    client_fn = resolve(data.pop("client_fn"), "client_fn")
    evaluate = data.pop("evaluate_fn", None)
    evaluate_fn = resolve(evaluate, "evaluate_fn") if evaluate is not None else None
    table = dict(data.pop("strategy", {"name": "fedavg"}))
    name = str(table.pop("name", "fedavg")).lower()
    if name not in STRATEGIES:
        raise ValueError(f"{path}: strategy.name={name!r}: choose one of {sorted(STRATEGIES)}")
    strategy = _build(path, "strategy", STRATEGIES[name], table)
    if "dp" in data:
        data["dp"] = _build(path, "dp", DP, data["dp"])
    if "edge" in data:
        edge = data["edge"]
        if isinstance(edge, dict) and isinstance(edge.get("tls"), dict):
            # Relative paths are the job file's, wherever it is run from.
            files = {
                k: str(path.parent / v) if isinstance(v, str) else v for k, v in edge["tls"].items()
            }
            edge = {**edge, "tls": _build(path, "edge.tls", Tls, files)}
        data["edge"] = _build(path, "edge", EdgeConfig, edge)
    if tls is not None:
        if not isinstance(data.get("edge"), EdgeConfig):
            raise ValueError(f"{path}: --tls-cert/--tls-key are for edge clients: add [edge]")
        data["edge"] = dataclasses.replace(data["edge"], tls=tls)
    data.update({k: v for k, v in overrides.items() if v is not None})
    config = _build(path, None, RunConfig, data)
    return FederatedJob(client_fn, evaluate_fn, strategy, config)
