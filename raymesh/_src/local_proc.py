"""The caller's own process as a proc mesh of one: `this_proc()`.

In an actor's process it is that proc (a reference: the actor's owner owns the proc). In the
controller it is a `LocalProc`: actors spawned on it run in the controller's process, with the
same ordering and the same errors as on a real proc.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any

from raymesh._src import backend
from raymesh._src.context import current_rank, provide_this_proc
from raymesh._src.errors import MeshFailure
from raymesh._src.mesh_state import ProcMeshState
from raymesh._src.proc import ProcRuntime
from raymesh._src.proc_mesh import ProcMesh, owner_key
from raymesh._src.shape import Point, Shape

__all__ = ["LocalProc", "this_proc"]


class LocalProc:
    """The controller's own process as a proc, for `this_proc()` in the controller.

    Messages go through the same `ProcRuntime` as on a real proc (same ordering, same errors),
    on a local thread pool; arguments are pickled and unpickled, as they would be on the wire.
    """

    pid = -1
    node_id = ""
    in_process = True  # its events reach this process's supervision without a watch

    def __init__(self) -> None:
        self._state: ProcMeshState | None = None
        self.runtime = ProcRuntime(
            proc_mesh_name="controller", point=current_rank(), on_event=self._on_event
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="raymesh-local")

    def _on_event(self, actor_key: str | None, failure: MeshFailure) -> None:
        from raymesh._src.supervision import dispatch

        if self._state is not None:
            dispatch(self._state, actor_key, failure)

    def submit(
        self,
        actor_key: str,
        sender: str,
        seq: int,
        endpoint: str,
        payload: Any,
        message_point: tuple,
        reply: bool,
    ) -> concurrent.futures.Future:
        args, kwargs = _copy(payload)
        return self._pool.submit(
            self.runtime.handle,
            actor_key,
            sender,
            seq,
            endpoint,
            args,
            kwargs,
            message_point,
            reply,
        )

    def spawn(
        self,
        actor_key: str,
        mesh_name: str,
        point: Point,
        cls: type,
        payload: Any,
        spawner: Any = None,
    ) -> Any:
        args, kwargs = _copy(payload)
        return self._pool.submit(
            self.runtime.spawn, actor_key, mesh_name, point, cls, args, kwargs, spawner
        )

    def stop_actor(self, actor_key: str) -> None:
        self.runtime.stop_actor(actor_key)

    def exit_status(self, timeout: float) -> None:
        return None

    def __reduce__(self):
        raise TypeError(
            "an actor spawned with this_proc() in the controller lives in the controller's "
            "process and cannot be sent to other actors; spawn it on procs from spawn_procs() "
            "to share it"
        )


def _copy(payload: Any) -> Any:
    if type(payload) is list:  # stored once for a fan-out call
        payload = backend.get(payload, None)[0]
    return backend.roundtrip(payload)


_local_proc: LocalProc | None = None


def this_proc() -> ProcMesh:
    """The caller's own process as a mesh of one: actors spawned on it run in this process."""
    global _local_proc
    proc = backend.self_proc()
    if proc is not None:
        state = ProcMeshState(f"proc-{proc.pid}", [proc], None, owner_key(), owned=False)
        return ProcMesh(state, Shape.of({}))
    if _local_proc is None:
        _local_proc = LocalProc()
        state = ProcMeshState("controller", [_local_proc], None, None, owned=False)
        _local_proc._state = state
    assert _local_proc._state is not None
    return ProcMesh(_local_proc._state, Shape.of({}))


provide_this_proc(this_proc)  # context().actor_instance.proc, without context importing us
