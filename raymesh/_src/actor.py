"""`Actor`: the base class of user actors.

Guarantees (the same for every actor, on every proc):
- One message at a time: an actor runs one endpoint (or its constructor, or `__supervise__`)
  at a time; several actors on the same proc run concurrently with each other.
- FIFO per caller: messages from one caller (the controller, or one actor's process) to one
  actor run in the order they were sent. Messages from different callers interleave.
- Async endpoints run on the proc's event loop, still one message at a time per actor: an
  `await` inside an endpoint does not let the next message of the same actor start. Inside an
  async endpoint, wait on other meshes with `await future`, not `future.get()`.
- An exception in an endpoint is returned to the caller as `ActorError`; the actor keeps serving.
  In a `broadcast` (nobody waits for the reply) it goes to the mesh owner's supervision instead.
- Arguments arrive as copies (pickled; CPU tensors through Ray's shared-memory object store,
  zero-copy, as read-only views: `clone()` a received tensor before changing it in place).

Supervision: an actor that spawns meshes owns them. When one fails, the owner's
`__supervise__(failure)` runs (as a message, in turn with its endpoints). Return True to handle
it; anything else passes it up to the owner's own owner, and at the controller to
`raymesh.unhandled_fault_hook`.
"""

from __future__ import annotations

from raymesh._src.errors import MeshFailure

__all__ = ["Actor"]


class Actor:
    """Subclass this and mark remotely callable methods with `@endpoint`."""

    def __supervise__(self, failure: MeshFailure) -> bool:
        """Called when a mesh this actor spawned fails. Return True to handle it."""
        return False
