"""The Ray cluster raymesh runs on, for code above the core (the commands, topology's
discovery): connect to it, list its nodes, probe them. A facade: the core's `_src` stays
private, and nothing above the core imports it (tests/unit/test_layers.py checks).

    from raymesh import cluster
    cluster.ensure_ray()        # RAYMESH_ADDRESS / RAY_ADDRESS, the local runtime, else a
                                # local Ray of our own
    for node in cluster.nodes():
        print(node.hostname, node.cpus, node.gpus)
"""

from raymesh._src.backend import (
    NodeInfo,
    ProbeReport,
    address,
    attached,
    current_node_id,
    ensure_ray,
    nodes,
    probe,
    ray_version,
    started_local,
)
from raymesh._src.backend.local_runtime import RuntimeStartError, down, status, up
from raymesh._src.backend.runtime_file import RuntimeDirError, RuntimeLostError, RuntimeRecord
from raymesh._src.host_mesh import RankPlacement

__all__ = [
    "NodeInfo",
    "ProbeReport",
    "RankPlacement",
    "RuntimeDirError",
    "RuntimeLostError",
    "RuntimeRecord",
    "RuntimeStartError",
    "address",
    "attached",
    "current_node_id",
    "down",
    "ensure_ray",
    "nodes",
    "probe",
    "ray_version",
    "started_local",
    "status",
    "up",
]
