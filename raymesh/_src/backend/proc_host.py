"""The proc host: the Ray actor that *is* a proc, hosting a `ProcRuntime`.

A threaded Ray actor, not an async one: on this project's 2-core machines a threaded actor's
round trip measured within noise of a plain actor's, an async actor's ~1.6x slower. Messages
run on the default concurrency group's threads; the runtime orders them per caller and
serialises them per actor. Control calls (spawn, watch, info) have their own group so a backlog
of messages never starves them.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from raymesh._src import context as _ctx
from raymesh._src.backend import runtime
from raymesh._src.proc import ProcRuntime, set_current_runtime
from raymesh._src.shape import Point

# Threads for messages. Each in-flight message holds one while it waits for its turn, so this
# bounds how many messages a proc accepts at once (Ray queues the rest, in order).
MESSAGE_THREADS = 256


class _ProcHost:
    def __init__(self, proc_mesh_name: str, point: Point) -> None:
        runtime.quiet_zero_copy_warnings()
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
    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}


ProcHost: Any = ray.remote(  # type: ignore[call-overload]  # stubs omit these options
    max_concurrency=MESSAGE_THREADS, concurrency_groups={"control": 16}
)(_ProcHost)


def _fmt(point: Point) -> str:
    return "[" + ",".join(f"{k}={v}" for k, v in point.items()) + "]"
