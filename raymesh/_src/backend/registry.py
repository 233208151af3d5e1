"""The job's registry: values kept by name for every process of one Ray job, each changed by one
caller at a time.

One Ray actor per job, named `raymesh-registry-<job id>` (so two jobs sharing a namespace never
share it), threaded, reserving no resources. `update(name, make)` runs `make(current)` in the
registry's own process, under that name's lock: `current` is the name's value (None the first
time), and `make` returns the new value to keep there and the reply to send back. Because `make`
runs in the registry, whatever it spawns is owned by the registry, not by the caller: the
layer above uses this for controllers (`raymesh._src.controllers`) that must outlive the actor
that first asked for them. Different names change concurrently; a `make` that waits on another
name of the registry is fine, one that waits on its own name deadlocks.

Who owns the registry, and so when it ends: the job's driver, in effect, so that it ends with
the job, and with it everything its `make`s spawned. It is created the first time anyone asks
for it (a job that never does has no registry process). When the driver asks first, the driver
creates it (non-detached). When an actor asks first, its host's agent creates it (see
`host_agent`): the agent of a host where the driver spawned procs is the driver's, and lives as
long as the job. (On a host where only actors spawned procs, the agent, and so the registry,
belongs to the actor that spawned there first.) It runs on the host of its creator.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raymesh._src.backend import runtime
from raymesh._src.backend.host_agent import PREFIX as AGENT_PREFIX
from raymesh._src.backend.host_agent import own_agent
from raymesh._src.backend.proc_host import inherited_origin

# Threads of the registry: each `make` that spawns holds one for seconds.
_THREADS = 64
_CREATE_TIMEOUT_S = 60.0

# make(current value or None) -> (value to keep, reply to the caller)
Make = Callable[[Any], tuple[Any, Any]]


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._locks: dict[str, threading.Lock] = {}
        self._values: dict[str, Any] = {}

    def __repr__(self) -> str:  # Ray prefixes forwarded stdout/stderr lines with this
        return "raymesh-registry"

    def update(self, name: str, make: Make) -> tuple[bool, Any]:
        """(True, reply), or (False, the exception `make` raised); on an exception the name's
        value stays as it was."""
        with self._lock:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            try:
                value, reply = make(self._values.get(name))
            except BaseException as e:
                return False, _picklable(e)
            self._values[name] = value
            return True, reply


Registry: Any = ray.remote(num_cpus=0, max_concurrency=_THREADS)(_Registry)  # type: ignore[call-overload]

_handles: dict[str, Any] = {}  # job id -> its registry (a process may outlive a Ray session)
_handles_lock = threading.Lock()


def create(name: str) -> Any:
    """The registry `name`, created by this process if it does not exist yet (then owned by
    this process), on this process's host."""
    here = ray.get_runtime_context().get_node_id()
    return Registry.options(
        name=name,
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=True),
    ).remote()


def registry() -> Any:
    """The handle of this job's registry (see the module docstring for who creates it)."""
    runtime.ensure_ray()
    ctx = ray.get_runtime_context()
    # A proc of the local runtime is a worker of the runtime's job: its program's registry is
    # the one of the job (and namespace) that adopted it.
    origin = inherited_origin()
    job = ctx.get_job_id() if origin is None else origin.job
    namespace = None if origin is None else origin.namespace
    with _handles_lock:
        handle = _handles.get(job)
        if handle is None:
            name = f"raymesh-registry-{job}"
            if ctx.worker.mode == ray.SCRIPT_MODE:
                handle = create(name)
            else:
                try:
                    handle = ray.get_actor(name, namespace=namespace)
                except ValueError:  # none yet: the driver's agent of this host creates it
                    agent = _drivers_agent(ctx.get_node_id(), namespace)
                    handle = ray.get(agent.own.remote(create, name), timeout=_CREATE_TIMEOUT_S)
            _handles[job] = handle
        return handle


def _drivers_agent(node_id: str, namespace: str | None) -> Any:
    """The driver's own agent of this host; in another job's namespace (a proc of the local
    runtime's), the one its program started as it attached (`procs.prepare`)."""
    if namespace is None:
        return own_agent(node_id)
    deadline = time.monotonic() + _CREATE_TIMEOUT_S
    while True:
        try:
            return ray.get_actor(
                runtime.node_actor_name(AGENT_PREFIX, node_id), namespace=namespace
            )
        except ValueError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)  # it is starting in the background


def update(name: str, make: Make) -> Any:
    """Run `make` on `name`'s value in the registry (see the module docstring). Returns the
    pending result: (True, reply), or (False, the exception `make` raised)."""
    return registry().update.remote(name, make)


def _picklable(error: BaseException) -> BaseException:
    """`error`, or a RuntimeError saying what it was when it cannot travel back to the caller."""
    try:
        ray.cloudpickle.dumps(error)
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error
