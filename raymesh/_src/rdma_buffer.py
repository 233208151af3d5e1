"""`RDMABuffer`: Monarch's one-sided tensor buffers. The process that makes one lends a tensor's
bytes; the buffer is a small handle that travels in ordinary messages; whoever holds it copies
the bytes with `read_into` / `write_from`, without the owner's participation.

How the bytes move, decided per copy (`backend` says which):
- "local": the reader is the owner: a plain copy.
- "process_vm": the reader runs on the owner's host and the tensor is in host memory: the
  kernel copies between the two processes' memories (`process_memory`), one copy, no thread
  of the owner involved: the one-host counterpart of an RDMA read.
- "object_store": otherwise (another host, a GPU tensor, a kernel that refuses, or
  `RAYMESH_RDMA_ONE_SIDED=0`): the owner's *proc* serves the copy on threads of its own
  (`backend.buffers`), through Ray's object store, as Monarch's TCP fallback is served by the
  owner proc's RDMA manager. The actor that made the buffer never sees it.

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
import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from raymesh._src import backend, process_memory
from raymesh._src.backend import buffers
from raymesh._src.backend.buffers import BufferDropped
from raymesh._src.context import context, proc_rank
from raymesh._src.errors import MeshFailure, SupervisionError
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
_peers: dict[tuple[int, int], process_memory.Peer] = {}
_refused: set[tuple[int, int]] = set()  # owners whose memory the kernel would not let us read
_lock = threading.Lock()
_readers_allowed = False


class BufferOwnerGone(SupervisionError):
    """The process that lent an `RDMABuffer` is gone, and its bytes with it. `failure` names
    the owner's mesh, rank and actor, as for any dead proc."""

    def __reduce__(self) -> Any:
        return (BufferOwnerGone, (self.failure,))


@dataclass(frozen=True)
class _Ref:
    """What travels: where the bytes are and who lends them (plain data plus the owner proc's
    handle, which Ray counts)."""

    buffer_id: int
    token: int
    nbytes: int
    dtype: Any  # torch.dtype
    shape: tuple[int, ...]
    device: str
    addr: int  # the bytes, in the owner's address space
    cell: int  # the token cell, in the owner's address space
    pid: int
    started: int
    host: str
    owner: Any  # the owner proc's host handle; None for the controller, which serves nothing
    owner_id: str
    mesh_name: str
    rank: int  # the owner proc's, in its proc mesh
    actor: str


_self: dict[int, tuple[int, int | None, str]] = {}


def _self_key() -> tuple[int, int | None, str]:
    """This process as a buffer names its owner (kept per pid: a forked child is another)."""
    pid = os.getpid()
    key = _self.get(pid)
    if key is None:
        key = _self[pid] = (pid, process_memory.start_time(pid), process_memory.host_key())
    return key


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
        proc = backend.self_proc()
        _allow_readers(proc is not None)
        buffer_id, token, cell = buffers.register(data)
        pid, started, host = _self_key()
        ctx = context()
        self._ref = _Ref(
            buffer_id, token, nbytes, data.dtype, tuple(data.shape), str(data.device),
            int(data.data_ptr()), cell, pid, started or 0, host,
            proc.handle if proc is not None else None, str(ctx.actor_instance.actor_id),
            ctx.proc_mesh_name, proc_rank(), repr(ctx.actor_instance),
        )  # fmt: skip

    @classmethod
    def _rebuild(cls, ref: _Ref) -> RDMABuffer:
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
        return _route(self._ref)

    def read_into(self, dst: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> Future[None]:
        """Copy the buffer's bytes into `dst`: a contiguous tensor (CPU or CUDA) of the
        buffer's dtype, or a byte view (`torch.uint8`), holding at least `size()` bytes; the
        first `size()` of them are written. The future resolves to None once they are there."""
        _check_timeout(timeout, "read_into")
        _check_tensor("read_into(dst)", dst, self._ref, reading=True)
        return self._submit("read_into", _read, dst, timeout)

    def write_from(self, src: Any, *, timeout: float = DEFAULT_TIMEOUT_S) -> Future[None]:
        """Copy `src`'s bytes into the buffer's first bytes: a contiguous tensor (CPU or CUDA)
        of the buffer's dtype, or a byte view, of at most `size()` bytes."""
        _check_timeout(timeout, "write_from")
        _check_tensor("write_from(src)", src, self._ref, reading=False)
        return self._submit("write_from", _write, src, timeout)

    def drop(self) -> Future[None]:
        """Stop lending the bytes, from any holder of the buffer: later copies through any
        handle of it raise `BufferDropped`, and the owner lets go of the tensor (after a grace
        of `backend.buffers.GRACE_S` seconds). A dead owner's buffer drops without error."""
        return self._submit("drop", _drop, None, DEFAULT_TIMEOUT_S)

    def _submit(self, what: str, fn: Any, tensor: Any, timeout: float) -> Future[None]:
        deadline = time.monotonic() + timeout
        done = _pool.submit(_run, fn, self._ref, tensor, deadline, what)
        # A dead owner proc seen through Ray (`backend.ProcGone`) becomes BufferOwnerGone here.
        return Future([done], lambda raws: None, _gone_error(self._ref), f"RDMABuffer.{what}")

    def __repr__(self) -> str:
        r = self._ref
        return f"RDMABuffer({r.nbytes} bytes, {r.dtype}{list(r.shape)} on {r.device}, {r.actor})"


def _run(fn: Any, ref: _Ref, tensor: Any, deadline: float, what: str) -> None:
    try:
        fn(ref, tensor, deadline)
    except process_memory.PeerGone as e:
        raise _gone_error(ref)(0, str(e)) from None
    except TimeoutError:
        raise TimeoutError(
            f"RDMABuffer.{what} of {ref.nbytes} bytes did not finish within its timeout: pass "
            f"a larger timeout= (the owner is {ref.actor})"
        ) from None


def _gone_error(ref: _Ref) -> Any:
    def error(_: int, detail: str) -> BufferOwnerGone:
        cause = f"the owner of an RDMABuffer ({ref.nbytes} bytes), {ref.actor}, is gone: {detail}"
        return BufferOwnerGone(
            MeshFailure(ref.mesh_name, (ref.rank,), "proc_died", cause, actor=ref.actor)
        )

    return error


def _route(ref: _Ref) -> str:
    pid, started, host = _self_key()
    if (ref.pid, ref.started, ref.host) == (pid, started, host):
        return "local"
    if (
        ref.device == "cpu"
        and ref.host == host
        and _one_sided()
        and process_memory.supported()
        and (ref.pid, ref.started) not in _refused
    ):
        return "process_vm"
    return "object_store" if ref.owner is not None else "none"


def _read(ref: _Ref, dst: Any, deadline: float) -> None:
    route = _route(ref)
    out = buffers.as_bytes(dst)[: ref.nbytes]
    if route == "local":
        _copy(out, buffers.as_bytes(buffers.lookup(ref.buffer_id, ref.token)))
    elif route == "process_vm" and _one_sided_or_refused(ref):
        peer = _peer(ref)
        _check_lent(peer, ref)
        landing = out if not out.is_cuda else _staging(ref.nbytes)
        peer.read(int(landing.data_ptr()), ref.addr, ref.nbytes, deadline)
        _check_lent(peer, ref)  # still lent after the copy: the bytes are the tensor's
        if landing is not out:
            _copy(out, landing)
    else:
        _need_owner_proc(ref)
        _copy(out, _call(ref, "read", None, deadline))


def _write(ref: _Ref, src: Any, deadline: float) -> None:
    route = _route(ref)
    data = buffers.as_bytes(src)
    if route == "local":
        _copy(buffers.as_bytes(buffers.lookup(ref.buffer_id, ref.token))[: data.numel()], data)
    elif route == "process_vm" and _one_sided_or_refused(ref):
        peer = _peer(ref)
        data = data.cpu() if data.is_cuda else data
        step = process_memory.CHUNK_BYTES
        for off in range(0, data.numel(), step):
            # Checked before each chunk: the owner holds a dropped tensor GRACE_S longer, so a
            # chunk that passed the check lands in live memory.
            _check_lent(peer, ref)
            size = min(step, data.numel() - off)
            peer.write(ref.addr + off, int(data.data_ptr()) + off, size, deadline)
        _check_lent(peer, ref)
    else:
        _need_owner_proc(ref)
        _call(ref, "write", data.cpu() if data.is_cuda else data, deadline)


def _drop(ref: _Ref, _: Any, deadline: float) -> None:
    route = _route(ref)
    try:
        if route == "local":
            buffers.drop(ref.buffer_id, ref.token)
        elif route == "process_vm" and _one_sided_or_refused(ref):
            peer = _peer(ref)
            # Zeroed only while it holds our token: a cell is reused (with a new token) only
            # GRACE_S after a drop, so this cannot zero another buffer's cell.
            if _cell(peer, ref) == ref.token:
                zero = ctypes.c_uint64(0)
                peer.write(ref.cell, ctypes.addressof(zero), 8, deadline)
        else:
            _need_owner_proc(ref)
            _call(ref, "drop", None, deadline)
    except (process_memory.PeerGone, backend.ProcGone):
        pass  # nothing is lent any more


def _one_sided_or_refused(ref: _Ref) -> bool:
    """Whether the kernel lets this process copy from the owner (a first 8-byte read tells);
    once refused, the owner's proc serves this process's copies from then on."""
    try:
        _cell(_peer(ref), ref)
        return True
    except PermissionError:
        with _lock:
            _refused.add((ref.pid, ref.started))
        return False


def _need_owner_proc(ref: _Ref) -> None:
    if ref.owner is None:
        raise RuntimeError(
            f"RDMABuffer: this buffer was made by the controller (pid {ref.pid}), which serves "
            "no requests, and this process cannot copy its bytes one-sidedly (another host, a "
            "GPU tensor, RAYMESH_RDMA_ONE_SIDED=0, or a kernel that refuses): make the buffer "
            "in an actor, whose proc serves it"
        )


def _call(ref: _Ref, op: str, src: Any, deadline: float) -> Any:
    left = max(0.0, deadline - time.monotonic())
    return buffers.call_owner(ref.owner, op, ref.buffer_id, ref.token, src, left)


def _peer(ref: _Ref) -> process_memory.Peer:
    key = (ref.pid, ref.started)
    with _lock:
        peer = _peers.get(key)
        if peer is None:
            peer = _peers[key] = process_memory.Peer(ref.pid, ref.started)
        return peer


def _cell(peer: process_memory.Peer, ref: _Ref) -> int:
    value = ctypes.c_uint64(0)
    peer.read(ctypes.addressof(value), ref.cell, 8, None)
    return value.value


def _check_lent(peer: process_memory.Peer, ref: _Ref) -> None:
    if _cell(peer, ref) != ref.token:
        raise BufferDropped(f"the RDMABuffer ({ref.nbytes} bytes, {ref.actor}) was dropped")


def _copy(out: Any, data: Any) -> None:
    out.copy_(data)
    if out.is_cuda or data.is_cuda:  # resolved means landed, whatever stream comes next
        import torch

        torch.cuda.synchronize(out.device if out.is_cuda else data.device)


def _staging(nbytes: int) -> Any:
    import torch

    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


def _check_timeout(timeout: Any, what: str) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(
            f"RDMABuffer.{what}(timeout={timeout!r}): pass a positive number of seconds "
            f"(default {DEFAULT_TIMEOUT_S})"
        )


def _check_tensor(name: str, t: Any, ref: _Ref, *, reading: bool) -> None:
    """Refuse, before any byte moves, a tensor that cannot take or give the buffer's bytes."""
    import torch

    held = f"{ref.nbytes} bytes ({ref.dtype}{list(ref.shape)})"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided or t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name}: a {t.layout} tensor on {t.device}: pass a dense CPU or CUDA one")
    if not t.is_contiguous():
        raise ValueError(
            f"{name}: the tensor (shape {tuple(t.shape)}, stride {t.stride()}) is not "
            "contiguous, so its bytes are not one run: pass a contiguous tensor (x.contiguous() "
            "is a copy" + ("; read into it, then copy it back into x)" if reading else ")")
        )
    if t.dtype != ref.dtype and torch.uint8 not in (t.dtype, ref.dtype):
        raise TypeError(
            f"{name}: the tensor's dtype is {t.dtype} but the buffer holds {held}: pass a "
            f"{ref.dtype} tensor, or a byte view of any tensor (x.view(torch.uint8))"
        )
    nbytes = t.numel() * t.element_size()
    if reading and nbytes < ref.nbytes:
        raise ValueError(
            f"{name}: the tensor holds {nbytes} bytes ({t.dtype}{list(t.shape)}) but the "
            f"buffer holds {held}: read into a tensor of at least {ref.nbytes} bytes"
        )
    if not reading and nbytes > ref.nbytes:
        raise ValueError(
            f"{name}: the tensor holds {nbytes} bytes ({t.dtype}{list(t.shape)}) but the "
            f"buffer holds only {held}: write at most {ref.nbytes} bytes (a slice of x)"
        )


def _one_sided() -> bool:
    value = os.environ.get("RAYMESH_RDMA_ONE_SIDED", "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"RAYMESH_RDMA_ONE_SIDED={value!r}: use 1 (copies on the owner's host go one-sided "
            "through the kernel; the default) or 0 (every copy goes through the owner's proc)"
        )
    return value == "1"


def _allow_readers(in_proc: bool) -> None:
    global _readers_allowed
    if in_proc and not _readers_allowed:
        _readers_allowed = True
        process_memory.allow_node_readers()


def is_available() -> bool:
    """Whether `RDMABuffer` works here: always, in raymesh (one-sided on one host, through the
    owner's proc elsewhere). Monarch's says whether RDMA hardware is present."""
    return True


is_rdma_available = is_available


def get_rdma_backend() -> str:
    """How copies between procs of this host go: "process_vm" (one-sided, through the kernel),
    or "object_store" (served by the owner's proc). Monarch's answers "ibverbs", "tcp" or
    "none"."""
    one_sided = _one_sided() and process_memory.supported()
    return "process_vm" if one_sided else "object_store"
