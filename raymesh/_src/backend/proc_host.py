"""The proc host: the Ray actor that *is* a proc, hosting a `ProcRuntime`.

A threaded Ray actor, not an async one: on this project's 2-core machines a threaded actor's
round trip measured within noise of a plain actor's, an async actor's ~1.6x slower. Messages
run on the default concurrency group's threads; the runtime orders them per caller and
serialises them per actor. Control calls (spawn, watch, info) have their own group so a backlog
of messages never starves them.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import ray
from ray._private import ray_constants

from raymesh._src import context as _ctx
from raymesh._src.backend import runtime
from raymesh._src.proc import ProcRuntime, set_current_runtime
from raymesh._src.shape import Point

# Threads for messages. Each in-flight message holds one while it waits for its turn, so this
# bounds how many messages a proc accepts at once (Ray queues the rest, in order).
MESSAGE_THREADS = 256


class _ProcHost:
    def __init__(self, proc_mesh_name: str | None, point: Point | None) -> None:
        """A proc of `proc_mesh_name` at `point`; or, with None for both, a warm proc that
        imports what a proc will need and waits to be adopted (see `backend.pool`)."""
        runtime.quiet_zero_copy_warnings()
        self._name = "raymesh-warm-proc"
        if proc_mesh_name is None or point is None:
            _preload()
        else:
            self._join(proc_mesh_name, point)

    def _join(self, proc_mesh_name: str, point: Point) -> None:
        self._name = f"{proc_mesh_name}{_fmt(point)}"
        _ctx.set_proc_point(point)
        self.runtime = ProcRuntime(proc_mesh_name=proc_mesh_name, point=point)
        set_current_runtime(self.runtime)

    def __repr__(self) -> str:  # Ray prefixes forwarded stdout/stderr lines with this
        return self._name

    def handle(self, message: tuple) -> Any:
        actor_key, sender, seq, endpoint, payload, message_point, reply = message
        if type(payload) is list:  # stored once in the object store for a fan-out call
            payload = ray.get(payload[0])
        args, kwargs = payload
        return self.runtime.handle(
            actor_key, sender, seq, endpoint, args, kwargs, message_point, reply
        )

    @ray.method(concurrency_group="control")
    def spawn(self, actor_key: str, mesh_name: str, point: Point, cls: type, payload: Any) -> Any:
        if type(payload) is list:
            payload = ray.get(payload[0])
        args, kwargs = payload
        return self.runtime.spawn(actor_key, mesh_name, point, cls, args, kwargs)

    @ray.method(concurrency_group="control")
    def stop_actor(self, actor_key: str) -> None:
        self.runtime.stop_actor(actor_key)

    @ray.method(concurrency_group="control")
    def watch(self, timeout: float) -> list:
        return self.runtime.watch(timeout)

    @ray.method(concurrency_group="control")
    def adopt(self, proc_mesh_name: str, point: Point, threads: int | None) -> None:
        """Make this warm proc the proc at `point` of `proc_mesh_name` (once). `threads`: the
        OMP_NUM_THREADS Ray would have given a proc of its CPUs (None: leave it as it is)."""
        if hasattr(self, "runtime"):
            raise RuntimeError(f"{self._name} already belongs to a mesh")
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(threads)
        self._join(proc_mesh_name, point)
        # Ray names an actor's forwarded output after its repr at creation; say the new name.
        for stream in (sys.stdout, sys.stderr):
            print(f"{ray_constants.LOG_PREFIX_ACTOR_NAME}{self._name}", file=stream, flush=True)

    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


ProcHost: Any = ray.remote(  # type: ignore[call-overload]  # stubs omit these options
    max_concurrency=MESSAGE_THREADS, concurrency_groups={"control": 16}
)(_ProcHost)


# What a warm proc imports while it waits: each costs seconds on a small machine, and nearly
# every proc needs them (any tensor argument, any training rank). Missing ones are skipped.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel")


def _preload() -> None:
    for module in PRELOAD:
        try:
            importlib.import_module(module)
        except ImportError:
            pass


def _fmt(point: Point) -> str:
    return "[" + ",".join(f"{k}={v}" for k, v in point.items()) + "]"
