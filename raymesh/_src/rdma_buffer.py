"""`RDMABuffer`: Monarch's one-sided tensor buffers. The process that makes one lends a tensor's
bytes; the buffer is a small handle that travels in ordinary messages; whoever holds it copies
the bytes with `read_into` / `write_from`, without the owner's participation.

How the bytes move is `buffer_copy`'s: one-sided through the kernel on the owner's host
("process_vm"), else served by the owner's proc through Ray's object store ("object_store").

Guarantees:
- Bad input fails before any byte moves: `TypeError` / `ValueError` naming the argument, the
  value and the fix (a non-contiguous tensor, a dtype other than the buffer's or a byte view,
  too few bytes to read into, too many to write from).
- A copy returns a `Future`; it runs on a thread of this process, never on an actor's thread
  or event loop, so `await buf.read_into(t)` never blocks the loop.
- An owner whose process is gone fails the copy with `BufferOwnerGone` (a `SupervisionError`
  whose failure names the owner), at once on the one-sided path (the kernel says so) and as
  soon as Ray reports the proc dead on the other. Every copy gives up after `timeout` seconds
  (`TimeoutError`).
- A copy through a dropped buffer raises `BufferDropped`; a one-sided read that overlapped the
  drop raises it too, rather than returning bytes that may have changed.
- A copy into or from a CUDA tensor leaves it on its device (bytes are staged through host
  memory); the future resolves once they are there.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

from raymesh._src import buffer_copy, process_memory
from raymesh._src.buffer_copy import BufferDropped, BufferOwnerGone, BufferRef
from raymesh._src.future import Future

__all__ = [
    "BufferDropped",
    "BufferOwnerGone",
    "RDMABuffer",
    "get_rdma_backend",
    "is_available",
    "is_rdma_available",
]

DEFAULT_TIMEOUT_S = 60  # Monarch's default for read_into / write_from
_pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="raymesh-rdma")


class RDMABuffer:
    """A tensor's bytes, lent by the process that made it (see the module).

    `RDMABuffer(data)`: `data` is any contiguous CPU or CUDA tensor (Monarch asks for 1-D:
    `t.view(torch.uint8).flatten()` works here too). The owner keeps lending it until `drop()`;
    keep its storage as it is meanwhile (no `resize_`), as RDMA requires of registered memory.
    """

    def __init__(self, data: Any) -> None:
        import torch

        if not isinstance(data, torch.Tensor):
            raise TypeError(
                f"RDMABuffer(data): expected a torch.Tensor, got {type(data).__name__}; for "
                "raw bytes pass torch.frombuffer(b, dtype=torch.uint8)"
            )
        if data.layout != torch.strided or data.device.type not in ("cpu", "cuda"):
            raise ValueError(
                f"RDMABuffer(data): a {data.layout} tensor on {data.device} has no bytes to "
                "lend: pass a dense CPU or CUDA tensor"
            )
        if not data.is_contiguous():
            raise ValueError(
                f"RDMABuffer(data): the tensor (shape {tuple(data.shape)}, stride "
                f"{data.stride()}) is not contiguous, so its bytes are not one run: pass "
                "data.contiguous() and keep that tensor"
            )
        nbytes = data.numel() * data.element_size()
        if nbytes == 0:
            raise ValueError("RDMABuffer(data): the tensor is empty: there is nothing to lend")
        self._ref = buffer_copy.lend(data)

    @classmethod
    def _rebuild(cls, ref: BufferRef) -> RDMABuffer:
        buf = cls.__new__(cls)
        buf._ref = ref
        return buf

    def __reduce__(self) -> Any:
        return (RDMABuffer._rebuild, (self._ref,))

    def size(self) -> int:
        """The buffer's length in bytes."""
        return self._ref.nbytes

    @property
    def owner(self) -> str:
        """The id of the actor that made the buffer (Monarch's `owner`)."""
        return self._ref.owner_id

    @property
    def backend(self) -> str:
        """How this process's copies of the buffer go: "local", "process_vm", "object_store",
        or "none" (a controller's buffer that this process cannot reach one-sidedly)."""
        return buffer_copy.route(self._ref)

    def read_into(self, dst: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> Future[None]:
        """Copy the buffer's bytes into `dst`: a contiguous tensor (CPU or CUDA) of the
        buffer's dtype, or a byte view (`torch.uint8`), holding at least `size()` bytes; the
        first `size()` of them are written. The future resolves to None once they are there."""
        buffer_copy.check_timeout(timeout, "read_into")
        buffer_copy.check_tensor("read_into(dst)", dst, self._ref, reading=True)
        return self._submit("read_into", buffer_copy.read, dst, timeout)

    def write_from(self, src: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> Future[None]:
        """Copy `src`'s bytes into the buffer's first bytes: a contiguous tensor (CPU or CUDA)
        of the buffer's dtype, or a byte view, of at most `size()` bytes."""
        buffer_copy.check_timeout(timeout, "write_from")
        buffer_copy.check_tensor("write_from(src)", src, self._ref, reading=False)
        return self._submit("write_from", buffer_copy.write, src, timeout)

    def drop(self) -> Future[None]:
        """Stop lending the bytes, from any holder of the buffer: later copies through any
        handle of it raise `BufferDropped`, and the owner lets go of the tensor (after a grace
        of `backend.buffers.GRACE_S` seconds). A dead owner's buffer drops without error."""
        return self._submit("drop", buffer_copy.drop, None, DEFAULT_TIMEOUT_S)

    def _submit(self, what: str, fn: Any, tensor: Any, timeout: float) -> Future[None]:
        deadline = time.monotonic() + timeout
        done = _pool.submit(buffer_copy.run, fn, self._ref, tensor, deadline, what)
        # A dead owner proc seen through Ray (`backend.ProcGone`) becomes BufferOwnerGone here.
        return Future(
            [done], lambda raws: None, buffer_copy.gone_error(self._ref), f"RDMABuffer.{what}"
        )

    def __repr__(self) -> str:
        r = self._ref
        return f"RDMABuffer({r.nbytes} bytes, {r.dtype}{list(r.shape)} on {r.device}, {r.actor})"


def is_available() -> bool:
    """Whether `RDMABuffer` works here: always, in raymesh (one-sided on one host, through the
    owner's proc elsewhere). Monarch's says whether RDMA hardware is present."""
    return True


is_rdma_available = is_available


def get_rdma_backend() -> str:
    """How copies between procs of this host go: "process_vm" (one-sided, through the kernel),
    or "object_store" (served by the owner's proc). Monarch's answers "ibverbs", "tcp" or
    "none"."""
    one_sided = buffer_copy.one_sided() and process_memory.supported()
    return "process_vm" if one_sided else "object_store"
