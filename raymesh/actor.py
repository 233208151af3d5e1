"""The programming model: actors, endpoints, meshes, futures and supervision.

`from raymesh.actor import Actor, endpoint, this_host` (the same names are in `raymesh`).
"""

import sys
from collections.abc import Callable
from typing import Any

from raymesh._src.accumulator import Accumulator
from raymesh._src.actor import Actor
from raymesh._src.actor_mesh import ActorMesh, EndpointRef, send
from raymesh._src.backend import PlacementError
from raymesh._src.bootstrap import attach_to_workers, run_worker_loop_forever
from raymesh._src.channel import Channel, PortReceiver
from raymesh._src.context import (
    ActorContext,
    context,
    current_actor_name,
    current_rank,
    current_size,
)
from raymesh._src.controllers import get_or_spawn_controller
from raymesh._src.endpoint import Endpoint, concurrent_endpoint, endpoint
from raymesh._src.errors import ActorError, MeshFailure, SupervisionError
from raymesh._src.future import Future
from raymesh._src.host_mesh import HostMesh, host_mesh, hosts_from_config, this_host
from raymesh._src.local_proc import this_proc
from raymesh._src.port import Port
from raymesh._src.proc_mesh import ProcMesh, preload, shutdown_context
from raymesh._src.shape import Extent, Point, Shape
from raymesh._src.shared import Shared
from raymesh._src.supervision import FrontModule, set_unhandled_fault_hook
from raymesh._src.value_mesh import ValueMesh

__all__ = [
    "Accumulator",
    "Actor",
    "ActorContext",
    "ActorError",
    "ActorMesh",
    "Channel",
    "Endpoint",
    "EndpointRef",
    "Extent",
    "Future",
    "HostMesh",
    "MeshFailure",
    "PlacementError",
    "Point",
    "Port",
    "PortReceiver",
    "ProcMesh",
    "Shape",
    "Shared",
    "SupervisionError",
    "ValueMesh",
    "attach_to_workers",
    "concurrent_endpoint",
    "context",
    "current_actor_name",
    "current_rank",
    "current_size",
    "endpoint",
    "get_or_spawn_controller",
    "host_mesh",
    "hosts_from_config",
    "preload",
    "run_worker_loop_forever",
    "send",
    "set_unhandled_fault_hook",
    "shutdown_context",
    "this_host",
    "this_proc",
    "unhandled_fault_hook",
]

# The controller's unhandled-fault hook, read and assigned as this attribute (Monarch's way:
# `raymesh.actor.unhandled_fault_hook = fn`), or with set_unhandled_fault_hook.
unhandled_fault_hook: Callable[[MeshFailure], Any]
sys.modules[__name__].__class__ = FrontModule
