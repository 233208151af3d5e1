"""raymesh.federated: federated learning's parts. Non-IID partitions, strategies (FedAvg,
FedProx, FedAdam, FedYogi), secure aggregation (pairwise masking over X25519 with Shamir-shared
seeds) and client-level differential privacy with Opacus's accountant.

The round driver over meshes of client procs, the edge client over HTTP and `raymesh
federated` are not built yet (issue 16)."""

from raymesh.federated.partition import dirichlet_partition
from raymesh.federated.privacy import DP, PrivacyAccountant, clip_update
from raymesh.federated.secagg import FixedPoint, SecAggClient, SecAggError, SecAggServer
from raymesh.federated.strategy import FedAdam, FedAvg, FedProx, FedYogi, Strategy, Update

__all__ = [
    "DP",
    "FedAdam",
    "FedAvg",
    "FedProx",
    "FedYogi",
    "FixedPoint",
    "PrivacyAccountant",
    "SecAggClient",
    "SecAggError",
    "SecAggServer",
    "Strategy",
    "Update",
    "clip_update",
    "dirichlet_partition",
]
