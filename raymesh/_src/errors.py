"""The typed failures a caller sees: `ActorError`, `SupervisionError` and its `MeshFailure`.

- `ActorError`: an endpoint raised. The actor is alive and keeps serving; the error carries the
  remote exception's type, message and formatted traceback.
- `SupervisionError`: a proc of the mesh is gone (killed, crashed, stopped), or a fault was left
  unhandled by the mesh's owner. It carries a `MeshFailure` that names the mesh, the ranks and
  the cause (exit code or signal where the host could read them).
"""

from __future__ import annotations

import signal as _signal
import time
import traceback
from dataclasses import dataclass, field

__all__ = ["ActorError", "MeshFailure", "RemoteFailure", "SupervisionError"]


@dataclass(frozen=True)
class MeshFailure:
    """What went wrong on a mesh: plain data, picklable, safe to log or send to another actor.

    kind:
      - "proc_died": the processes at `ranks` are gone; `exit_code` or `signal` say how when the
        host agent saw the exit (a SIGKILL gives `signal=9`).
      - "endpoint_error": a `broadcast` (fire-and-forget) message raised at `ranks`; nobody
        was waiting on a result, so, as in Monarch, the actor failed and the failure went to
        supervision instead.
      - "actor_failed": an actor at `ranks` ended on a BaseException that is not an
        Exception (SystemExit, KeyboardInterrupt), an escaped explicit-port error, or
        `context().actor_instance.abort()`.
      - "init_error": the actor's constructor raised at `ranks` (`spawn` still returns the
        mesh; calls on it raise SupervisionError).
      - "child_failed": an actor at `ranks` owned a mesh that failed (`child`) and did not
        handle it.
      - "stopped": the mesh was stopped by its owner.

    actor: the failed actor as Monarch names it, `<module.Class mesh-name{'axis': i/n}>`, where
    one is known (for a dead proc: an actor that ran on it); `report()` leads with it.
    """

    mesh_name: str
    ranks: tuple[int, ...]
    kind: str
    cause: str
    exit_code: int | None = None
    signal: int | None = None
    child: MeshFailure | None = None
    actor: str | None = None
    time: float = field(default_factory=time.time)

    @property
    def signal_name(self) -> str | None:
        if self.signal is None:
            return None
        try:
            return _signal.Signals(self.signal).name
        except ValueError:
            return f"signal {self.signal}"

    def __str__(self) -> str:
        """Monarch's form, `MeshFailure(mesh_name=..., crashed_ranks=[...], event=...)`, which
        programs and people search for; then ` <- ` and the child's, down the chain."""
        text = (
            f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={list(self.ranks)}, "
            f"event={self.kind}: {self.cause})"
        )
        if self.child is not None:
            text += f" <- {self.child}"
        return text

    def report(self) -> str:
        """Monarch's `report()`: where the failure started, in Monarch's words ("The actor
        <...> and all its descendants have failed:" and, indented, what happened to it: for a
        dead proc "the process this actor was running on failed: Killed(sig=9)"), then
        raymesh's chain, one line per level from this failure down to that one."""
        leaf = self
        while leaf.child is not None:
            leaf = leaf.child
        who = leaf.actor or f"on mesh {leaf.mesh_name!r} rank(s) {_ranks(leaf.ranks)}"
        lines = [f"The actor {who} and all its descendants have failed:", f"  {leaf._what()}"]
        lines.append("How it came here:")
        failure: MeshFailure | None = self
        depth = 1
        while failure is not None:
            lines.append(f"{'  ' * depth}{failure.kind}: {failure._line()}")
            failure, depth = failure.child, depth + 1
        return "\n".join(lines)

    def _what(self) -> str:
        """What happened to the failed actor, worded as Monarch words it."""
        if self.kind != "proc_died":
            return self.cause
        if self.signal is not None:
            return f"the process this actor was running on failed: Killed(sig={self.signal})"
        if self.exit_code:
            return (
                f"the process this actor was running on exited with non-zero code {self.exit_code}"
            )
        return f"the process this actor was running on failed: {self.cause}"

    def _line(self) -> str:
        return f"mesh {self.mesh_name!r} rank(s) {_ranks(self.ranks)}: {self.cause}"


def _ranks(ranks: tuple[int, ...]) -> str:
    return ",".join(map(str, ranks))


class SupervisionError(RuntimeError):
    """A call could not complete because its mesh failed. `failure` says how."""

    def __init__(self, failure: MeshFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure

    def __reduce__(self):  # keep the failure across pickling (Ray, actor-to-actor)
        return (SupervisionError, (self.failure,))


class ActorError(RuntimeError):
    """An endpoint raised. The remote actor is still alive and serving.

    Attributes: `mesh_name`, `rank`, `endpoint`, `remote_type` (qualified name of the remote
    exception's class), `remote_message`, `remote_traceback` (formatted, from the remote process).
    """

    def __init__(
        self,
        *,
        mesh_name: str,
        rank: int,
        endpoint: str,
        remote_type: str,
        remote_message: str,
        remote_traceback: str,
    ) -> None:
        self.mesh_name = mesh_name
        self.rank = rank
        self.endpoint = endpoint
        self.remote_type = remote_type
        self.remote_message = remote_message
        self.remote_traceback = remote_traceback
        super().__init__(  # "Actor call <mesh>.<endpoint> failed": Monarch's words
            f"Actor call {mesh_name}.{endpoint} failed at rank {rank}: {remote_type}: "
            f"{remote_message}\n\nRemote traceback:\n{remote_traceback}"
        )

    def __reduce__(self):
        return (_rebuild_actor_error, (self.__dict__.copy(),))


def _rebuild_actor_error(state: dict) -> ActorError:
    state = {k: v for k, v in state.items() if not k.startswith("_") and k != "args"}
    return ActorError(**state)


@dataclass(frozen=True)
class RemoteFailure:
    """The marker a proc returns in place of a result when the endpoint raised.

    Returned, not raised, so that Ray does not log it as an unhandled task error and the reply
    path stays the same for success and failure.
    """

    remote_type: str
    remote_message: str
    remote_traceback: str

    @classmethod
    def from_exception(cls, exc: BaseException) -> RemoteFailure:
        t = type(exc)
        name = t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"
        return cls(name, str(exc), "".join(traceback.format_exception(exc)))

    def to_error(self, *, mesh_name: str, rank: int, endpoint: str) -> ActorError:
        return ActorError(
            mesh_name=mesh_name,
            rank=rank,
            endpoint=endpoint,
            remote_type=self.remote_type,
            remote_message=self.remote_message,
            remote_traceback=self.remote_traceback,
        )
