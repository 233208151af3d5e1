"""Connecting to Ray: the embedded local default, or an existing cluster.

Order of preference, first match wins:
1. Ray is already initialised in this process (the user called `ray.init(...)`, or this code runs
   inside a Ray worker, e.g. an actor spawning a nested mesh): use it as it is.
2. `RAYMESH_ADDRESS` is set: `ray.init(address=RAYMESH_ADDRESS)`.
3. `RAY_ADDRESS` is set (as under `ray job submit`): `ray.init()` connects to it.
4. A local runtime started by `raymesh up` is up on this machine (`runtime_file`) and runs
   what this program runs: attach to it, and take its warm procs (`shared_pool`).
   `RAYMESH_RUNTIME=0` skips this step.
5. Otherwise start a local Ray on loopback (the embedded default), with
   `RAYMESH_NUM_CPUS` logical CPUs (default max(64, cores)): a proc reserves one logical CPU,
   so a small machine can still gang-schedule a mesh of many CPU procs, which then share cores.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raymesh._src.backend import ray_output, runtime_file, zero_copy
from raymesh._src.backend.runtime_file import RuntimeLostError, RuntimeRecord
from raymesh._src.backend.switches import switch

logger = logging.getLogger("raymesh")

_init_lock = threading.Lock()
_started_local = False
_connected = False  # raymesh called ray.init (not the user, not a Ray worker)
_attached: RuntimeRecord | None = None  # the local runtime this process attached to
_lost: RuntimeLostError | None = None  # set by the watcher once that runtime is gone
_quiescers: list[Callable[[], None]] = []
_connect_hooks: list[Callable[[], None]] = []
_shutdown_hooks: list[Callable[[], None]] = []
_exit_hook_after_init = False  # _at_exit is registered to run before Ray's own exit hook


def before_shutdown(fn: Callable[[], None]) -> None:
    """Call `fn()` before Ray shuts down, whether by `shutdown()` or at interpreter exit.

    Guarantee: once `fn` returns, the background thread it stands for makes no Ray call until
    Ray is up again. A thread still inside a Ray call while Ray shuts down can crash the
    process (a segfault in Ray's core worker), so every raymesh thread that calls into Ray on
    its own (the supervisor, the warm-proc fillers) registers here."""
    _add(_quiescers, fn)


def on_connect(fn: Callable[[], None]) -> None:
    """Call `fn()` each time raymesh connects this process to Ray itself (its own `ray.init`,
    not the user's or a Ray worker's): the modules above this one start what a new session
    needs (the host agent, warm procs) without this module importing them."""
    _add(_connect_hooks, fn)


def on_shutdown(fn: Callable[[], None]) -> None:
    """Call `fn()` in `shutdown()`, after the `before_shutdown` hooks and before Ray shuts
    down (not at interpreter exit, where Ray's own shutdown ends everything anyway)."""
    _add(_shutdown_hooks, fn)


def _add(hooks: list[Callable[[], None]], fn: Callable[[], None]) -> None:
    with _init_lock:
        if fn not in hooks:
            hooks.append(fn)


def node_actor(
    cls: Any, prefix: str, node_id: str, cache: dict, lock: Any, namespace: str | None = None
) -> Any:
    """The actor `cls` of a node, pinned there and created on first use; named
    `node_actor_name(prefix, node_id)` (in `namespace`, else this job's), so every process of
    the cluster (of the job) shares the one actor."""
    with lock:
        actor = cache.get(node_id)
        if actor is None:
            actor = cls.options(
                name=node_actor_name(prefix, node_id),
                namespace=namespace,
                get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote()
            cache[node_id] = actor
        return actor


def node_actor_name(prefix: str, node_id: str) -> str:
    return f"{prefix}-{node_id[:16]}"


def _quiesce() -> None:
    for fn in list(_quiescers):
        try:
            fn()
        except Exception:
            logger.warning("raymesh: stopping %r before Ray's shutdown failed", fn, exc_info=True)


def _at_exit() -> None:
    if _lost is not None:
        # The runtime is gone: every Ray call would block on its dead GCS, and the interpreter's
        # own end, with Ray's threads still waiting on it, blocks 60 s and then crashes. The
        # program's exception is printed by now; end it with a failure status at once.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    _quiesce()


def _run_quiesce_before_rays_exit_hook() -> None:
    # atexit runs hooks last-registered first, and ray.init registers ray.shutdown each time:
    # registering after it (moving ours to the end) makes ours run first.
    global _exit_hook_after_init
    if not _exit_hook_after_init:
        atexit.unregister(_at_exit)
        atexit.register(_at_exit)
        _exit_hook_after_init = True


def _loopback_only() -> None:
    """Make the embedded local Ray use 127.0.0.1 as its node address. Ray otherwise resolves
    even an explicit 127.0.0.1 to the machine's routable address; its single-machine mode (the
    one it uses on macOS and Windows) keeps everything on loopback."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


_INIT_TIMEOUT_S = 300.0


def attach(address: str, *, log_to_driver: bool = True, level: int = logging.WARNING) -> None:
    """`ray.init` to the local runtime's head at `address` (on loopback: Ray would otherwise
    dial the machine's routable address instead of 127.0.0.1)."""
    _loopback_only()
    if "RAY_AUTH_MODE" not in os.environ:
        # The runtime's Ray, as every new local Ray, checks Ray's token (~/.ray/auth_token,
        # this user's); a program attaching to an address does not send it unless told.
        from ray._private.authentication import authentication_token_setup as auth

        auth._enable_token_auth()
    ray.init(address=address, log_to_driver=log_to_driver, logging_level=level)


def _init_local(**kwargs: object) -> None:
    """`ray.init(**kwargs)` starting a local node, from a thread that lives as long as the
    process. Ray starts the node's processes with PR_SET_PDEATHSIG, which fires when the
    *thread* that started them ends: started from a worker thread (a thread pool spawning
    meshes), the whole local cluster would die with that thread."""
    if threading.current_thread() is threading.main_thread():
        ray.init(**kwargs)  # type: ignore[arg-type]
        return
    started = threading.Event()
    failed: list[BaseException] = []

    def keep() -> None:
        try:
            ray.init(**kwargs)  # type: ignore[arg-type]
        except BaseException as e:
            failed.append(e)
            started.set()
            return
        started.set()
        threading.Event().wait()  # never returns: this thread is the node's parent

    threading.Thread(target=keep, name="raymesh-local-ray", daemon=True).start()
    if not started.wait(timeout=_INIT_TIMEOUT_S):
        raise TimeoutError(f"the local Ray did not start within {_INIT_TIMEOUT_S:g} s")
    if failed:
        raise failed[0]


def ensure_ray() -> None:
    """Make sure this process is connected to Ray (see the module docstring for which Ray)."""
    global _started_local, _connected, _attached
    if ray.is_initialized():
        if not _exit_hook_after_init:  # the user's ray.init, or a Ray worker's
            with _init_lock:
                _run_quiesce_before_rays_exit_hook()
        return
    with _init_lock:
        if ray.is_initialized():
            _run_quiesce_before_rays_exit_hook()
            return
        zero_copy.enable()
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # never phone home
        forward_logs = switch(
            "RAYMESH_FORWARD_LOGS",
            True,
            on="procs' output is printed by the controller",
            off="it stays in Ray's log files",
        )
        address = os.environ.get("RAYMESH_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=forward_logs, logging_level=logging.WARNING)
        elif os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=forward_logs, logging_level=logging.WARNING)
        elif (record := runtime_file.find()) is not None:
            attach(record.address, log_to_driver=forward_logs)
            _attached = record
            _watch(record)
            logger.info(
                "raymesh: attached to the local runtime at %s (`raymesh up`, pid %d, up %s, "
                "%d logical CPUs); `raymesh down` stops it",
                record.address,
                record.pid,
                runtime_file.uptime(record.started),
                record.cpus,
            )
        else:
            cpus = int(os.environ.get("RAYMESH_NUM_CPUS", max(64, os.cpu_count() or 1)))
            _loopback_only()
            ray_output.quiet_token_auth_notice()
            _init_local(
                address="local",  # always a new instance, even if another Ray runs here
                num_cpus=cpus,
                include_dashboard=switch(
                    "RAYMESH_DASHBOARD", False, on="Ray's dashboard starts", off="it does not"
                ),
                _node_ip_address="127.0.0.1",  # the embedded default stays on loopback
                log_to_driver=forward_logs,
                logging_level=logging.WARNING,
                configure_logging=True,
            )
            _started_local = True
            logger.info(
                "raymesh: started a local Ray with %d logical CPUs on %d cores (a proc takes "
                "one; procs share the cores)",
                cpus,
                os.cpu_count() or 1,
            )
        _connected = True
        ray_output.quiet_raylet_noise()
        _run_quiesce_before_rays_exit_hook()
        for fn in list(_connect_hooks):
            fn()


def attached() -> RuntimeRecord | None:
    """The local runtime this process attached to (None: it did not attach to one)."""
    return _attached if ray.is_initialized() else None


_WATCH_S = 0.5  # how often an attached program looks at its runtime's daemon


def _watch(record: RuntimeRecord) -> None:
    """Watch the runtime's daemon from a thread: once it is gone, every wait of this program
    raises `RuntimeLostError` (`check_runtime`) within about a second. Ray alone would leave
    the program blocked until its GCS client gives up, 60 s later, and then end the process
    without a Python exception."""

    def watch() -> None:
        global _lost
        while _attached is record:
            if not runtime_file.alive(record):
                _lost = RuntimeLostError(
                    f"the local runtime at {record.address} (`raymesh up`, pid {record.pid}) "
                    "this program attached to is gone, and its procs with it; fix: start it "
                    "again with `raymesh up` and rerun the program (or run it with "
                    "RAYMESH_RUNTIME=0 on a Ray of its own)"
                )
                logger.error("raymesh: %s", _lost)
                # Ray's hook for an uncaught exception records it in the dead GCS: it would
                # block 60 s, and Ray would then end the process (see `_at_exit`).
                if getattr(sys.excepthook, "__module__", "").startswith("ray."):
                    sys.excepthook = sys.__excepthook__
                return
            time.sleep(_WATCH_S)

    threading.Thread(target=watch, name="raymesh-runtime-watch", daemon=True).start()


def check_runtime() -> None:
    """Raise `RuntimeLostError` if the local runtime this program attached to is gone."""
    if _lost is not None:
        raise _lost


def runtime_lost() -> bool:
    """Whether the local runtime this program attached to is gone (see `_watch`)."""
    return _lost is not None


def started_local() -> bool:
    return _started_local


def join(address: str) -> None:
    """Connect this process to the Ray cluster at `address`, unless it is connected already:
    a mesh unpickled in a process that has no Ray yet (a `multiprocessing` child of the
    controller) joins its cluster as a second client before its procs' handles are read."""
    if ray.is_initialized() or address in ("", "local"):
        return
    os.environ.setdefault("RAYMESH_ADDRESS", address)
    ensure_ray()


def connected() -> bool:
    """Whether raymesh made this process's Ray connection (a user's `ray.init` is theirs)."""
    return _connected and ray.is_initialized()


def shutdown() -> None:
    """Disconnect from Ray (and stop the local one, if raymesh started it)."""
    global _started_local, _connected, _exit_hook_after_init, _attached
    if _lost is not None:  # nothing is left to stop, and Ray's calls would block on its GCS:
        return  # the program ends at its exit (`_at_exit`)
    if ray.is_initialized():
        _quiesce()
        for fn in list(_shutdown_hooks):
            fn()
        ray.shutdown()
    _started_local = _connected = _exit_hook_after_init = False
    _attached = None
    ray_output.forget_adopted()


@dataclass(frozen=True)
class NodeInfo:
    """One alive Ray node, as raymesh sees a host."""

    node_id: str
    ip: str
    hostname: str
    cpus: float
    gpus: float
    memory_bytes: float
    labels: dict[str, str] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)


def nodes() -> list[NodeInfo]:
    """Alive Ray nodes, the controller's own node first, then by node id."""
    ensure_ray()
    here = current_node_id()
    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources", {})
        out.append(
            NodeInfo(
                node_id=n["NodeID"],
                ip=n.get("NodeManagerAddress", ""),
                hostname=n.get("NodeManagerHostname", ""),
                cpus=res.get("CPU", 0.0),
                gpus=res.get("GPU", 0.0),
                memory_bytes=res.get("memory", 0.0),
                labels=dict(n.get("Labels", {}) or {}),
                resources=dict(res),
            )
        )
    out.sort(key=lambda n: (n.node_id != here, n.node_id))
    return out


def available_resources() -> dict[str, float]:
    """Cluster-wide resources not reserved right now (for error messages)."""
    ensure_ray()
    return dict(ray.available_resources())


def current_node_id() -> str:
    ensure_ray()
    return ray.get_runtime_context().get_node_id()


def address() -> str:
    ensure_ray()
    ctx = ray.get_runtime_context()
    return getattr(ctx, "gcs_address", "") or "local"


def ray_version() -> str:
    """The version of the Ray this process runs."""
    return str(ray.__version__)


def node_ip() -> str:
    """This process's node address, as other processes of the cluster reach it."""
    ensure_ray()
    return ray.util.get_node_ip_address()


def gpu_ids() -> list:
    """The GPUs Ray gave this process (empty in the controller and in CPU procs, which Ray
    2.60 no longer hides the machine's GPUs from)."""
    return list(ray.get_gpu_ids()) if ray.is_initialized() else []
