"""The proc host: the Ray actor that *is* a proc, hosting a `ProcRuntime`.

The runtime comes from the layer above (`raymesh._src.proc.start_proc_runtime`, handed down as
`start_runtime` when the proc joins a mesh): the backend carries messages to it, and never
imports it.

A threaded Ray actor, not an async one: on this project's 2-core machines a threaded actor's
round trip measured within noise of a plain actor's, an async actor's ~1.6x slower. Messages
arrive two ways: small ones from callers on this host over the proc's channel (see `channel`),
run on the channel's threads; the rest as Ray calls, run on the default concurrency group's
threads. The runtime orders them per caller and serialises them per actor, whichever way they
came. Control calls (spawn, watch, info) have their own group so a backlog of messages never
starves them, and so do the reads and writes of lent buffers (`buffers`), which no actor sees.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import ray
from ray._private import ray_constants

from raymesh._src.backend import buffers, channel, log_barrier, proc_exit, zero_copy
from raymesh._src.errors import MeshFailure, RemoteFailure
from raymesh._src.shape import Point

# Threads for messages (on each path). Each in-flight message holds one while it waits for its
# turn, so this bounds how many messages a proc runs at once (the rest queue, in order).
MESSAGE_THREADS = 256
# Threads serving other processes' reads and writes of the buffers this proc lent: copies of
# many MiB each, kept off the message and control threads.
BUFFER_THREADS = 4


class HostedRuntime(Protocol):
    """What a proc host runs its messages on: `raymesh._src.proc.ProcRuntime`."""

    def handle(
        self,
        actor_key: str,
        sender: str,
        seq: int,
        endpoint: str,
        args: tuple,
        kwargs: dict,
        message_point: tuple[tuple[str, ...], tuple[int, ...], int],
        reply: bool,
        undeliverable: BaseException | None = None,
        /,
    ) -> Any: ...

    def spawn(
        self,
        actor_key: str,
        mesh_name: str,
        point: Point,
        cls: type,
        args: tuple,
        kwargs: dict,
        spawner: Any,
        /,
    ) -> RemoteFailure | None: ...

    def stop_actor(self, actor_key: str, /) -> None: ...

    def stop_all(self, timeout: float, /) -> None: ...

    def watch(
        self, timeout: float, route: str | None, /
    ) -> list[tuple[str | None, MeshFailure]] | None: ...


# Makes the calling process the proc at a point of a mesh (mesh name, point): sets its rank and
# returns the runtime its messages go to. A module-level function, so Ray sends it by reference.
StartRuntime = Callable[[str, Point], HostedRuntime]


class _ProcHost:
    def __init__(
        self,
        proc_mesh_name: str | None,
        point: Point | None,
        start_runtime: StartRuntime | None,
        imports: tuple[str, ...] = (),
        origin: Any = None,
    ) -> None:
        """A proc of `proc_mesh_name` at `point`, running `start_runtime`'s runtime; or, with
        None for all three, a warm proc that imports what a proc will need (`imports`, see
        `pool.imports`) and waits to be adopted (see `backend.pool`). `origin`: the program the
        proc that spawns this one was adopted by (`inherited_origin`), whose path, directory
        and environment it takes too (it is that proc's, and ends with it)."""
        if origin is not None:
            _take_origin(origin, watch=False)
        zero_copy.enable()
        self._name = "raymesh-warm-proc"
        self._channel = channel.Server(self._deliver, RemoteFailure.from_exception, MESSAGE_THREADS)
        self._preloading: threading.Thread | None = None
        if proc_mesh_name is None or point is None or start_runtime is None:
            self._preloading = threading.Thread(
                target=_preload, args=(imports,), name="raymesh-preload", daemon=True
            )
            self._preloading.start()
        else:
            self._join(proc_mesh_name, point, start_runtime)

    def _join(self, proc_mesh_name: str, point: Point, start_runtime: StartRuntime) -> None:
        self._name = f"{proc_mesh_name}{_fmt(point)}"
        self.runtime = start_runtime(proc_mesh_name, point)

    def __repr__(self) -> str:  # Ray prefixes forwarded stdout/stderr lines with this
        return self._name

    def handle(self, message: tuple) -> Any:
        actor_key, sender, seq, endpoint, payload, message_point, reply = message
        if type(payload) is list:  # stored once in the object store for a fan-out call
            payload = ray.get(payload[0])
        return self._deliver((actor_key, sender, seq, endpoint, message_point, reply), payload)

    def _deliver(self, header: tuple, payload: Any, error: BaseException | None = None) -> Any:
        actor_key, sender, seq, endpoint, message_point, reply = header
        args, kwargs = payload if error is None else ((), {})
        return self.runtime.handle(
            actor_key, sender, seq, endpoint, args, kwargs, message_point, reply, error
        )

    @ray.method(concurrency_group="control")
    def take_reply(self, msgid: bytes) -> Any:
        """A reply to a channel message that was too large (or held Ray objects) to send back
        over the channel: it travels through Ray instead."""
        return self._channel.take_reply(msgid)

    @ray.method(concurrency_group="buffers")
    def buffer_op(self, op: str, buffer_id: int, token: int, src: Any = None) -> Any:
        """A read, write or drop of an `RDMABuffer` this proc lent (`buffers.serve`), for a
        reader that cannot copy one-sidedly: served by the proc on threads of its own, never by
        the actor that made the buffer, whose endpoints neither see nor wait for it."""
        return buffers.serve(op, buffer_id, token, src)

    @ray.method(concurrency_group="control")
    def spawn(
        self,
        actor_key: str,
        mesh_name: str,
        point: Point,
        cls: type,
        payload: Any,
        spawner: Any = None,
    ) -> Any:
        if type(payload) is list:
            payload = ray.get(payload[0])
        args, kwargs = payload
        return self.runtime.spawn(actor_key, mesh_name, point, cls, args, kwargs, spawner)

    @ray.method(concurrency_group="control")
    def stop_actor(self, actor_key: str) -> None:
        self.runtime.stop_actor(actor_key)

    @ray.method(concurrency_group="control")
    def stop_all(self, timeout: float) -> None:
        self.runtime.stop_all(timeout)

    @ray.method(concurrency_group="control")
    def watch(self, timeout: float, route: str | None = None) -> list | None:
        return self.runtime.watch(timeout, route)

    @ray.method(concurrency_group="control")
    def exit(self) -> None:
        """End this process as a Python program ends (see `proc_exit`): Ray lets its calls in
        flight return, then the `atexit` handlers run and the program's module globals are
        finalized."""
        proc_exit.finalize()
        ray.actor.exit_actor()

    @ray.method(concurrency_group="control")
    def adopt(
        self,
        proc_mesh_name: str,
        point: Point,
        start_runtime: StartRuntime,
        threads: int | None,
        origin: Any = None,
    ) -> None:
        """Make this warm proc the proc at `point` of `proc_mesh_name` (once). `threads`: the
        OMP_NUM_THREADS Ray would have given a proc of its CPUs (None: leave it as it is).
        `origin` (a `shared_pool.Origin`): the program adopting a proc of the local runtime,
        whose path, directory and environment it takes, and with whose process it ends."""
        if hasattr(self, "runtime"):
            raise RuntimeError(f"{self._name} already belongs to a mesh")
        if origin is not None:
            _take_origin(origin, watch=True)
        if self._preloading is not None and self._preloading.is_alive():
            # The mesh waits for it now: back to normal priority, where the OS allows it.
            _set_idle(self._preloading, False)
            self._preloading.join()
        if threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(threads)
            if "torch" in sys.modules:
                sys.modules["torch"].set_num_threads(threads)
        self._join(proc_mesh_name, point, start_runtime)
        # Ray names an actor's forwarded output after its repr at creation; say the new name.
        for stream in (sys.stdout, sys.stderr):
            print(f"{ray_constants.LOG_PREFIX_ACTOR_NAME}{self._name}", file=stream, flush=True)

    @ray.method(concurrency_group="control")
    def info(self) -> dict[str, Any]:
        """Where this proc runs; answered once it is ready (a warm proc: its imports done)."""
        if self._preloading is not None:
            self._preloading.join()
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "channel": self._channel.address,
            "logs": log_barrier.worker_log_files(),  # before any redirection (logging_option)
        }


ProcHost: Any = ray.remote(  # type: ignore[call-overload]  # stubs omit these options
    max_concurrency=MESSAGE_THREADS, concurrency_groups={"control": 16, "buffers": BUFFER_THREADS}
)(_ProcHost)


def _preload(modules: tuple[str, ...]) -> None:
    # In the background: the pool refills behind every spawn, so warm procs mostly import while
    # a job runs, and must not take its CPUs (measured here: a 2-rank job trained at half speed
    # while two warm procs imported beside it at Ray's usual worker priority). Only this thread
    # (Linux schedules threads one by one): once it ends, the proc runs as any other.
    _set_idle(threading.current_thread(), True)
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # a warm proc must start anyway: the module fails again, visibly, on use
            pass


_origin: Any = None  # the program this proc was adopted by (see `adopt`), if any


def inherited_origin() -> Any:
    """The origin that procs this one spawns take (None: this proc is its program's own)."""
    return _origin


def job_id() -> str:
    """The Ray job (hex id) of the program this process works for: for a warm proc of the
    local runtime, the program that adopted it."""
    return _origin.job if _origin is not None else ray.get_runtime_context().get_job_id()


def _take_origin(origin: Any, *, watch: bool) -> None:
    global _origin
    _origin = origin
    sys.path[:0] = [p for p in origin.sys_path if p not in sys.path]
    os.environ.update(origin.env)
    try:
        os.chdir(origin.cwd)
    except OSError:
        pass  # as a proc of a remote host would, it runs from where it is

    def outlive_never() -> None:
        # Ray ends the procs a program owns with it; this proc is the runtime's, so it ends
        # itself once its program is gone (exit status 0: nobody is left to tell).
        while origin.alive():
            time.sleep(_OWNER_POLL_S)
        os._exit(0)

    if watch:
        threading.Thread(target=outlive_never, name="raymesh-owner", daemon=True).start()


_OWNER_POLL_S = 0.5


def _fmt(point: Point) -> str:
    return "[" + ",".join(f"{k}={v}" for k, v in point.items()) + "]"


def _set_idle(thread: threading.Thread, idle: bool) -> None:
    """Run `thread` only when nothing else wants the CPU (SCHED_IDLE), or as usual again."""
    if sys.platform != "linux" or thread.native_id is None:
        return
    policy = os.SCHED_IDLE if idle else os.SCHED_OTHER
    try:
        os.sched_setscheduler(thread.native_id, policy, os.sched_param(0))
    except OSError:  # leaving SCHED_IDLE needs CAP_SYS_NICE: it then finishes in the background
        pass
