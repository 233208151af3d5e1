"""raymesh.federated: federated learning over procs of simulated clients and edge devices.

`run(client_fn, strategy, clients=..., rounds=...)` samples clients each round, trains them
where they live (thousands multiplexed onto a few procs, or edge devices over HTTP), and
applies the strategy to their mean update; with `secure_aggregation=True` the controller sees
only masked updates and their exact sum, and with `dp=DP(...)` updates are clipped, noised and
accounted by Opacus. The parts (strategies, secure aggregation, DP, partitions) are usable alone.
`EdgeConfig(tls=Tls(cert=..., key=...))` serves edge devices over HTTPS.
"""

from raymesh._common import Tls
from raymesh.federated.aggregation.secagg_server import SecAggServer
from raymesh.federated.aggregation.strategy import (
    FedAdam,
    FedAvg,
    FedProx,
    FedYogi,
    Strategy,
    Update,
)
from raymesh.federated.config import EdgeConfig
from raymesh.federated.federation import Result, RoundRecord, RunConfig, run
from raymesh.federated.jobfile import load_job
from raymesh.federated.protocol.client import Client
from raymesh.federated.protocol.privacy import DP, PrivacyAccountant, clip_update
from raymesh.federated.protocol.secagg import FixedPoint, SecAggClient, SecAggError
from raymesh.federated.simulation.partition import dirichlet_partition

__all__ = [
    "DP",
    "Client",
    "EdgeConfig",
    "FedAdam",
    "FedAvg",
    "FedProx",
    "FedYogi",
    "FixedPoint",
    "PrivacyAccountant",
    "Result",
    "RoundRecord",
    "RunConfig",
    "SecAggClient",
    "SecAggError",
    "SecAggServer",
    "Strategy",
    "Tls",
    "Update",
    "clip_update",
    "dirichlet_partition",
    "load_job",
    "run",
]
