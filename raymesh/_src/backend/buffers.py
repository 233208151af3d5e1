"""The owner's side of `RDMABuffer`s: the tensors this process lends out, each with a token cell
that readers check one-sidedly, and the proc's system path, which serves reads, writes and drops
where a one-sided copy cannot (a reader on another host, a GPU tensor, a kernel that refuses).

Guarantees:
- A registered tensor stays referenced by this table, so its memory stays valid, until its
  buffer is dropped and `GRACE_S` more seconds have passed: a one-sided copy that checked the
  token just before the drop still lands in live memory.
- Its cell holds the buffer's token (random, 63 bits) from registration to the drop, and 0 from
  the drop on. Cells are never freed, only reused with a fresh token, so a stale handle reading
  its cell sees a mismatch, never freed memory. A reader that sees its token in the cell after
  copying copied from the live tensor; a writer checks before each chunk.
- A drop made one-sidedly (another process zeroed the cell) is noticed within `SWEEP_S`.
- Requests served here run on the proc host's `buffers` threads (see `proc_host`): the actors
  that made the buffers never see them, and their endpoints never wait for them.
- Torch is imported on first use only: a proc that lends nothing never imports it here.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from raymesh._src.backend import refs

__all__ = ["BufferDropped", "call_owner", "drop", "lookup", "register", "serve"]

GRACE_S = 10.0  # a dropped tensor's memory outlives the drop by this much (see above)
SWEEP_S = 1.0  # how often the table looks for one-sided drops and expired graces
_SLAB = 4096  # token cells per slab (32 KiB)


class BufferDropped(RuntimeError):
    """The buffer was dropped (by `drop()` on any handle of it): its bytes are no longer lent."""


@dataclass
class _Entry:
    tensor: Any
    token: int
    cell: int
    dropped_at: float | None = None


class _Table:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slabs: list[Any] = []  # int64 tensors of token cells, never freed
        self._free: list[int] = []
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count(1)
        self._sweeping = False

    def register(self, tensor: Any) -> tuple[int, int, int]:
        """Lend `tensor`: (buffer id, token, address of its token cell)."""
        token = secrets.randbits(63) | 1
        with self._lock:
            cell = self._free.pop() if self._free else self._grow()
            self._set(cell, token)
            buffer_id = next(self._ids)
            self._entries[buffer_id] = _Entry(tensor, token, cell)
            if not self._sweeping:
                self._sweeping = True
                threading.Thread(target=self._sweep, name="raymesh-buffers", daemon=True).start()
            return buffer_id, token, self._address(cell)

    def lookup(self, buffer_id: int, token: int) -> Any:
        """The lent tensor; BufferDropped once it was dropped."""
        with self._lock:
            entry = self._entries.get(buffer_id)
            if entry is None or entry.token != token or entry.dropped_at is not None:
                raise BufferDropped(f"buffer {buffer_id} was dropped")
            if self._get(entry.cell) != token:  # zeroed one-sidedly
                entry.dropped_at = time.monotonic()
                raise BufferDropped(f"buffer {buffer_id} was dropped")
            return entry.tensor

    def drop(self, buffer_id: int, token: int) -> None:
        """Stop lending (idempotent; a stale token drops nothing)."""
        with self._lock:
            entry = self._entries.get(buffer_id)
            if entry is not None and entry.token == token and entry.dropped_at is None:
                self._set(entry.cell, 0)
                entry.dropped_at = time.monotonic()

    def _sweep(self) -> None:
        while True:
            time.sleep(SWEEP_S)
            now = time.monotonic()
            with self._lock:
                for buffer_id, entry in list(self._entries.items()):
                    if entry.dropped_at is None and self._get(entry.cell) != entry.token:
                        entry.dropped_at = now
                    if entry.dropped_at is not None and now - entry.dropped_at >= GRACE_S:
                        del self._entries[buffer_id]
                        self._free.append(entry.cell)
                if not self._entries:
                    self._sweeping = False
                    return

    def _grow(self) -> int:
        import torch

        self._slabs.append(torch.zeros(_SLAB, dtype=torch.int64))
        first = (len(self._slabs) - 1) * _SLAB
        self._free.extend(range(first + _SLAB - 1, first, -1))
        return first

    def _get(self, cell: int) -> int:
        return int(self._slabs[cell // _SLAB][cell % _SLAB])

    def _set(self, cell: int, value: int) -> None:
        self._slabs[cell // _SLAB][cell % _SLAB] = value

    def _address(self, cell: int) -> int:
        slab = self._slabs[cell // _SLAB]
        return int(slab.data_ptr()) + (cell % _SLAB) * slab.element_size()


_table = _Table()
register = _table.register
lookup = _table.lookup
drop = _table.drop


def as_bytes(tensor: Any) -> Any:
    """A contiguous tensor's bytes, as a flat uint8 view of the same memory."""
    import torch

    return tensor.detach().reshape(-1).view(torch.uint8)


def serve(op: str, buffer_id: int, token: int, src: Any = None) -> Any:
    """One request from a reader that cannot copy one-sidedly, run by the owner's proc:
    "read" -> the bytes (a CPU tensor: a GPU buffer is staged through host memory), "write"
    copies `src`'s bytes in, "drop". Failures come back as values (the exception), never as a
    failed Ray task, which would read as a dead proc."""
    try:
        if op == "drop":
            drop(buffer_id, token)
            return None
        data = as_bytes(lookup(buffer_id, token))
        if op == "read":
            return data.cpu().clone() if data.is_cuda else data
        if op == "write":
            data[: src.numel()].copy_(src)
            lookup(buffer_id, token)  # dropped meanwhile: say so (the bytes went nowhere live)
            return None
        raise ValueError(f"unknown buffer op {op!r}")
    except Exception as e:
        return e


def call_owner(
    owner: Any, op: str, buffer_id: int, token: int, src: Any, timeout: float | None
) -> Any:
    """`serve` on the owner's proc (`owner`: its proc host's handle), through Ray: the reply's
    bytes travel the object store (zero-copy on this node). Raises `refs.ProcGone` when the
    proc is gone, TimeoutError, or what `serve` returned as its failure."""
    ref = owner.buffer_op.remote(op, buffer_id, token, src)
    out = refs.get([ref], timeout)[0]
    if isinstance(out, BaseException):
        raise out
    return out
