"""How an `RDMABuffer`'s bytes move: the handle that travels (`BufferRef`), the owner's side
of lending (`lend`), and the copies (`read`, `write`, `drop`), each on the route chosen for it:
- "local": the reader is the owner: a plain copy.
- "process_vm": the reader runs on the owner's host and the tensor is in host memory: the
  kernel copies between the two processes' memories (`process_memory`), one copy, no thread
  of the owner involved: the one-host counterpart of an RDMA read.
- "object_store": otherwise (another host, a GPU tensor, a kernel that refuses, or
  `RAYMESH_RDMA_ONE_SIDED=0`): the owner's *proc* serves the copy on threads of its own
  (`backend.buffers`), through Ray's object store, as Monarch's TCP fallback is served by the
  owner proc's RDMA manager. The actor that made the buffer never sees it.
- "none": a controller's buffer that this process cannot copy one-sidedly (the controller
  serves no requests): the copy fails saying so.

Guarantees (the copies run on `rdma_buffer`'s threads; errors as `rdma_buffer` states them):
- `check_tensor` refuses, before any byte moves, a tensor that cannot take or give the bytes.
- A one-sided read checks the buffer's token in the owner's memory after copying: still
  there, the bytes were the lent tensor's; gone, `BufferDropped`. A one-sided write checks it
  before each chunk (the owner keeps a dropped tensor `backend.buffers.GRACE_S` longer).
- A process is named by pid and start time (`process_memory.Peer`): a gone owner, or a reused
  pid, is `BufferOwnerGone`, never another process's bytes.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from raymesh._src import backend, process_memory
from raymesh._src.backend import buffers
from raymesh._src.backend.buffers import BufferDropped
from raymesh._src.backend.switches import switch
from raymesh._src.context import context, proc_rank
from raymesh._src.errors import MeshFailure, SupervisionError

__all__ = [
    "BufferDropped",
    "BufferOwnerGone",
    "BufferRef",
    "check_tensor",
    "check_timeout",
    "drop",
    "gone_error",
    "lend",
    "one_sided",
    "read",
    "route",
    "run",
    "write",
]

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
class BufferRef:
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


def lend(data: Any) -> BufferRef:
    """Lend `data` (a checked, non-empty contiguous tensor) from this process: its handle."""
    proc = backend.self_proc()
    _allow_readers(proc is not None)
    buffer_id, token, cell = buffers.register(data)
    pid, started, host = _self_key()
    ctx = context()
    return BufferRef(
        buffer_id=buffer_id,
        token=token,
        nbytes=data.numel() * data.element_size(),
        dtype=data.dtype,
        shape=tuple(data.shape),
        device=str(data.device),
        addr=int(data.data_ptr()),
        cell=cell,
        pid=pid,
        started=started or 0,
        host=host,
        owner=proc.handle if proc is not None else None,
        owner_id=str(ctx.actor_instance.actor_id),
        mesh_name=ctx.proc_mesh_name,
        rank=proc_rank(),
        actor=repr(ctx.actor_instance),
    )


def run(fn: Any, ref: BufferRef, tensor: Any, deadline: float, what: str) -> None:
    """`fn(ref, tensor, deadline)` (`read`, `write`, `drop`), its failures said for `what`."""
    try:
        fn(ref, tensor, deadline)
    except process_memory.PeerGone as e:
        with _lock:  # its pidfd goes with it: a long-lived reader meets many owners
            _peers.pop((ref.pid, ref.started), None)
        raise gone_error(ref)(0, str(e)) from None
    except TimeoutError:
        raise TimeoutError(
            f"RDMABuffer.{what} of {ref.nbytes} bytes did not finish within its timeout: pass "
            f"a larger timeout= (the owner is {ref.actor})"
        ) from None


def gone_error(ref: BufferRef) -> Any:
    """(index, detail) -> the `BufferOwnerGone` naming `ref`'s owner (a `Future`'s on_gone)."""

    def error(_: int, detail: str) -> BufferOwnerGone:
        cause = f"the owner of an RDMABuffer ({ref.nbytes} bytes), {ref.actor}, is gone: {detail}"
        return BufferOwnerGone(
            MeshFailure(ref.mesh_name, (ref.rank,), "proc_died", cause, actor=ref.actor)
        )

    return error


def route(ref: BufferRef) -> str:
    """How this process's next copy of `ref` goes (see the module)."""
    pid, started, host = _self_key()
    if (ref.pid, ref.started, ref.host) == (pid, started, host):
        return "local"
    if (
        ref.device == "cpu"
        and ref.host == host
        and one_sided()
        and process_memory.supported()
        and (ref.pid, ref.started) not in _refused
    ):
        return "process_vm"
    return "object_store" if ref.owner is not None else "none"


def read(ref: BufferRef, dst: Any, deadline: float) -> None:
    way = route(ref)
    out = buffers.as_bytes(dst)[: ref.nbytes]
    if way == "local":
        _copy(out, buffers.as_bytes(buffers.lookup(ref.buffer_id, ref.token)))
    elif way == "process_vm" and _one_sided_or_refused(ref):
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


def write(ref: BufferRef, src: Any, deadline: float) -> None:
    way = route(ref)
    data = buffers.as_bytes(src)
    if way == "local":
        _copy(buffers.as_bytes(buffers.lookup(ref.buffer_id, ref.token))[: data.numel()], data)
    elif way == "process_vm" and _one_sided_or_refused(ref):
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


def drop(ref: BufferRef, _: Any, deadline: float) -> None:
    way = route(ref)
    try:
        if way == "local":
            buffers.drop(ref.buffer_id, ref.token)
        elif way == "process_vm" and _one_sided_or_refused(ref):
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


def _one_sided_or_refused(ref: BufferRef) -> bool:
    """Whether the kernel lets this process copy from the owner (a first 8-byte read tells);
    once refused, the owner's proc serves this process's copies from then on."""
    try:
        _cell(_peer(ref), ref)
        return True
    except PermissionError:
        with _lock:
            _refused.add((ref.pid, ref.started))
        return False


def _need_owner_proc(ref: BufferRef) -> None:
    if ref.owner is None:
        raise RuntimeError(
            f"RDMABuffer: this buffer was made by the controller (pid {ref.pid}), which serves "
            "no requests, and this process cannot copy its bytes one-sidedly (another host, a "
            "GPU tensor, RAYMESH_RDMA_ONE_SIDED=0, or a kernel that refuses): make the buffer "
            "in an actor, whose proc serves it"
        )


def _call(ref: BufferRef, op: str, src: Any, deadline: float) -> Any:
    left = max(0.0, deadline - time.monotonic())
    return buffers.call_owner(ref.owner, op, ref.buffer_id, ref.token, src, left)


def _peer(ref: BufferRef) -> process_memory.Peer:
    key = (ref.pid, ref.started)
    with _lock:
        peer = _peers.get(key)
        if peer is None:
            peer = _peers[key] = process_memory.Peer(ref.pid, ref.started)
        return peer


def _cell(peer: process_memory.Peer, ref: BufferRef) -> int:
    value = ctypes.c_uint64(0)
    peer.read(ctypes.addressof(value), ref.cell, 8, None)
    return value.value


def _check_lent(peer: process_memory.Peer, ref: BufferRef) -> None:
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


def check_timeout(timeout: Any, what: str) -> None:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(
            f"RDMABuffer.{what}(timeout={timeout!r}): pass a positive number of seconds "
            "(Monarch's default is 60)"
        )


def check_tensor(name: str, t: Any, ref: BufferRef, *, reading: bool) -> None:
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


def one_sided() -> bool:
    return switch(
        "RAYMESH_RDMA_ONE_SIDED",
        True,
        on="copies on the owner's host go one-sided through the kernel",
        off="every copy goes through the owner's proc",
    )


def _allow_readers(in_proc: bool) -> None:
    global _readers_allowed
    if in_proc and not _readers_allowed:
        _readers_allowed = True
        process_memory.allow_node_readers()
