"""Actor classes shared by the integration tests (importable by the procs)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from raymesh import (
    Actor,
    MeshFailure,
    context,
    current_rank,
    current_size,
    endpoint,
    this_host,
    this_proc,
)

if TYPE_CHECKING:  # procs import torch only where an endpoint uses it (cold procs start faster)
    import torch


class Counter(Actor):
    def __init__(self, start: int = 0) -> None:
        self.value = start

    @endpoint
    def incr(self, by: int = 1) -> int:
        self.value += by
        return self.value

    @endpoint
    def get(self) -> int:
        return self.value

    @endpoint
    def rank(self) -> int:
        return current_rank().rank

    @endpoint
    def where(self) -> dict:
        ctx = context()
        return {
            "rank": dict(ctx.rank),
            "message_rank": ctx.message_rank.rank,
            "message_extent": dict(ctx.message_rank.extent),
            "size": current_size(),
            "pid": os.getpid(),
        }

    @endpoint
    def slow(self, seconds: float) -> int:
        time.sleep(seconds)
        return current_rank().rank

    @endpoint
    def wait_for(self, path: str, timeout: float) -> int:
        """Busy until the file `path` exists (at most `timeout` seconds); returns the rank."""
        deadline = time.monotonic() + timeout
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return current_rank().rank

    @endpoint
    def countdown(self, step: float) -> int:
        """Reply after (last rank - my rank) * step seconds."""
        time.sleep((current_size()["procs"] - 1 - current_rank()["procs"]) * step)
        return current_rank()["procs"]

    @endpoint
    def fail(self, message: str) -> None:
        raise ValueError(message)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def die(self, how: str) -> None:
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(int(how))

    def not_an_endpoint(self) -> None:
        pass


class Recorder(Actor):
    """Appends whatever it is sent, to check delivery order."""

    def __init__(self) -> None:
        self.seen: list = []

    @endpoint
    def add(self, x) -> None:
        self.seen.append(x)

    @endpoint
    def log(self) -> list:
        return list(self.seen)


class AsyncWorker(Actor):
    def __init__(self) -> None:
        self.active = 0
        self.max_active = 0

    @endpoint
    async def work(self, seconds: float) -> int:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        await asyncio.sleep(seconds)
        self.active -= 1
        return current_rank().rank

    @endpoint
    async def overlap(self) -> int:
        return self.max_active


def _mapping_of(address: int) -> dict:
    """The memory mapping of this process that holds `address` (from /proc/self/maps): the
    file it maps (device, inode, path), the byte of that file at `address`, and whether the
    mapping is shared with other processes."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return {
                    "file": (fields[3], int(fields[4])),
                    "path": fields[5].strip() if len(fields) > 5 else "",
                    "byte": int(fields[2], 16) + address - low,
                    "shared": fields[1].endswith("s"),
                }
    raise AssertionError(f"address {address:#x} is in no mapping of pid {os.getpid()}")


class TensorActor(Actor):
    @endpoint
    def echo(self, t: torch.Tensor) -> torch.Tensor:
        return t

    @endpoint
    def memory_of(self, t: torch.Tensor) -> dict:
        """Where this process holds the tensor's data: its pid and the mapping it lies in."""
        return {"pid": os.getpid(), "numel": t.numel(), **_mapping_of(t.data_ptr())}

    @endpoint
    def write_or_read(self, t: torch.Tensor, gate: str) -> float | str:
        """Rank 0 tries to add 1 to its tensor in place, then opens the gate (the file
        `gate`); the other ranks wait for the gate, then read their tensor's first value."""
        if current_rank().rank == 0:
            try:
                t.add_(1)
            except Exception as e:  # a read-only tensor refuses
                return f"refused: {type(e).__name__}"
            finally:
                open(gate, "w").close()
            return "written"
        deadline = time.monotonic() + 30
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return float(t[0])

    @endpoint
    def checksum(self, t: torch.Tensor) -> float:
        return float(t.double().sum())

    @endpoint
    def make(self, n: int) -> torch.Tensor:
        import torch

        return torch.arange(n, dtype=torch.float32)


class Trainer(Actor):
    """Calls a mesh reference it was given: picks its own loader by its own coordinates."""

    def __init__(self, loaders) -> None:
        self.loaders = loaders

    @endpoint
    def fetch(self) -> int:
        mine = self.loaders.slice(**current_rank())
        return mine.rank.call_one().get(timeout=30)

    @endpoint
    def fetch_all(self) -> list:
        return sorted(self.loaders.rank.call().get(timeout=30).values())


class FailsToStart(Actor):
    """Its constructor raises."""

    def __init__(self, why: str) -> None:
        raise RuntimeError(f"cannot start: {why}")

    @endpoint
    def ping(self) -> str:
        return "pong"


class Parent(Actor):
    """Owns a child mesh; records the supervision events it receives."""

    def __init__(self, handle: bool) -> None:
        self.handle = handle
        self.failures: list[MeshFailure] = []
        self.procs = None
        self.children = None
        self.lock = threading.Lock()

    @endpoint
    def spawn_children(self, n: int, escalate: bool = True) -> list:
        self.procs = this_host().spawn_procs(
            per_host={"procs": n}, name="children", escalate=escalate
        )
        self.children = self.procs.spawn("kids", Counter, 100)
        return self.procs.pids

    @endpoint
    def spawn_broken_children(self) -> None:
        self.procs = this_host().spawn_procs(per_host={"procs": 1}, name="broken-children")
        self.children = self.procs.spawn("broken", FailsToStart, "no config")

    @endpoint
    def children_failure(self) -> MeshFailure | None:
        return self.procs.failure

    @endpoint
    def call_children(self) -> list:
        return self.children.incr.call(1).get(timeout=30).values()

    @endpoint
    def local_helper(self) -> int:
        helper = this_proc().spawn("helper", Counter, 7)
        return helper.incr.call_one(1).get(timeout=30)

    @endpoint
    def local_helper_pids(self) -> tuple[int, int]:
        """(this actor's pid, the pid its helper on this_proc() reports)."""
        helper = this_proc().spawn("pid-helper", Counter)
        return os.getpid(), helper.pid.call_one().get(timeout=30)

    @endpoint
    def seen(self) -> list:
        with self.lock:
            return list(self.failures)

    @endpoint
    def stop_children(self) -> None:
        self.procs.stop()

    def __supervise__(self, failure: MeshFailure) -> bool:
        with self.lock:
            self.failures.append(failure)
        return self.handle


_latches: dict[str, threading.Event] = {}  # one per name in each proc, whichever actor asks
_latches_lock = threading.Lock()


def _latch(name: str) -> threading.Event:
    with _latches_lock:
        return _latches.setdefault(name, threading.Event())


class Latch(Actor):
    """Waits on, or opens, a latch of its proc: two actors on one proc share the latch."""

    @endpoint
    def wait(self, name: str, timeout: float) -> bool:
        """Whether the latch `name` was opened within `timeout` seconds of starting to wait."""
        _latch(f"{name}:waiting").set()
        return _latch(name).wait(timeout)

    @endpoint
    def open(self, name: str, timeout: float) -> bool:
        """Open the latch `name` once an actor waits on it; whether one did within `timeout`."""
        waiting = _latch(f"{name}:waiting").wait(timeout)
        _latch(name).set()
        return waiting

    @endpoint
    def pid(self) -> int:
        return os.getpid()
