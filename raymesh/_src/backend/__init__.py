"""The only package that imports Ray for the runtime (Ray's libraries live with their users:
`raymesh/serve/_ray_serve.py`, `raymesh/data/_ray_data.py`). Everything above it speaks in
procs, pending results and failures; this package maps them onto Ray actors, placement groups
and the object store. Above the core, `raymesh.cluster` is its public face.

`pool` and `procs` hook what a new session starts and what `shutdown()` ends into `runtime`
(`on_connect`, `on_shutdown`), which never imports them. Importing them here puts the hooks in
place before any module of the package can run: Python runs a package's `__init__` first.
"""

from raymesh._src.backend.host_agent import host_agent
from raymesh._src.backend.placement import PlacementError, free_slots
from raymesh._src.backend.pool import is_module_name, preload
from raymesh._src.backend.probes import ProbeReport, probe, stop_probes
from raymesh._src.backend.proc_host import job_id
from raymesh._src.backend.procs import (
    ProcGroup,
    RayProc,
    create_procs,
    end,
    flush_output,
    kill,
    kill_pid,
    self_proc,
    wait_exited,
)
from raymesh._src.backend.refs import (
    ProcGone,
    arrivals,
    by_value,
    describe_unpicklable,
    done,
    get,
    is_ref,
    put,
    roundtrip,
    wait,
    when_done,
)
from raymesh._src.backend.registry import update as registry_update
from raymesh._src.backend.runtime import (
    NodeInfo,
    address,
    attached,
    before_shutdown,
    connected,
    current_node_id,
    ensure_ray,
    gpu_ids,
    join,
    node_ip,
    nodes,
    ray_version,
    runtime_lost,
    shutdown,
    started_local,
)
from raymesh._src.backend.runtime_file import RuntimeLostError

__all__ = [
    "NodeInfo",
    "PlacementError",
    "ProbeReport",
    "ProcGone",
    "ProcGroup",
    "RayProc",
    "RuntimeLostError",
    "address",
    "arrivals",
    "attached",
    "before_shutdown",
    "by_value",
    "connected",
    "create_procs",
    "current_node_id",
    "describe_unpicklable",
    "done",
    "end",
    "ensure_ray",
    "flush_output",
    "free_slots",
    "get",
    "gpu_ids",
    "host_agent",
    "is_module_name",
    "is_ref",
    "job_id",
    "join",
    "kill",
    "kill_pid",
    "node_ip",
    "nodes",
    "preload",
    "probe",
    "put",
    "ray_version",
    "registry_update",
    "roundtrip",
    "runtime_lost",
    "self_proc",
    "shutdown",
    "started_local",
    "stop_probes",
    "wait",
    "wait_exited",
    "when_done",
]
