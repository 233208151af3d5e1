"""raymesh.topology: what the cluster looks like, and where each rank should run.

    from raymesh import topology
    topo = topology.discover()  # hosts, GPUs (NVML), NVLink/PCIe links, measured network
    placement = topology.plan(topo, topology.JobShape(world_size=16, strategy="hsdp",
                                                      replicate=2, shard=8))
    placement.node_ids, placement.devices, placement.groups, placement.reason

`plan` is pure (its modules import neither Ray nor torch) and works as well on a hand-built
`Topology` (`Host.gpu_box`, `Topology.of`); only `discover()` talks to Ray. From a shell:
`raymesh topology [--json]`. See docs/topology.md.
"""

from __future__ import annotations

from raymesh.topology.discovery import discover
from raymesh.topology.job import JobShape
from raymesh.topology.model import Device, Host, Link, NumaNode, Topology
from raymesh.topology.planner import Assignment, Placement, plan, used

__all__ = [
    "Assignment",
    "Device",
    "Host",
    "JobShape",
    "Link",
    "NumaNode",
    "Placement",
    "Topology",
    "discover",
    "plan",
    "used",
]
