"""Actors for test_monarch_semantics (importable by the procs)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Any

from raymesh import (
    Actor,
    MeshFailure,
    Port,
    concurrent_endpoint,
    context,
    current_actor_name,
    endpoint,
    this_host,
)


class Gate(Actor):
    """A concurrent endpoint that waits for a plain one (Monarch's AsyncGate)."""

    def __init__(self) -> None:
        self.ready = asyncio.Event()
        self.unblock = asyncio.Event()
        self.started: list[int] = []

    @concurrent_endpoint
    async def wait(self) -> str:
        self.ready.set()
        await self.unblock.wait()
        return "done"

    @endpoint
    async def release_when_ready(self) -> str:
        await self.ready.wait()
        self.unblock.set()
        return "released"

    @endpoint
    async def ping(self) -> str:
        return "pong"

    @concurrent_endpoint
    async def record(self, i: int) -> int:
        self.started.append(i)  # before the first await: in the order the messages came
        await asyncio.sleep(0.05 * (i % 3))
        return i

    @endpoint
    async def log(self) -> list[int]:
        return list(self.started)

    @concurrent_endpoint
    async def fail(self, message: str) -> None:
        await asyncio.sleep(0)
        raise ValueError(message)


class Options(Actor):
    """Monarch's endpoint options, and replies through an explicit port."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.ports: list[Port] = []

    @endpoint(propagate="inspect", instrument=False)
    async def plain(self, x: int) -> int:
        return x + 1

    @endpoint(explicit_response_port=True)
    async def later(self, port: Port[str], seconds: float) -> None:
        def reply() -> None:
            time.sleep(seconds)
            port.send(f"from {threading.current_thread().name}")

        threading.Thread(target=reply, name="replier").start()

    @endpoint(explicit_response_port=True)
    async def early(self, port: Port[str], seconds: float) -> None:
        port.send("started")
        await asyncio.sleep(seconds)
        self.log.append("body")

    @endpoint
    async def ping(self) -> str:
        self.log.append("ping")
        return "pong"

    @endpoint
    async def seen(self) -> list[str]:
        return list(self.log)

    @endpoint(explicit_response_port=True)
    async def refuse(self, port: Port[int], message: str) -> None:
        port.exception(KeyError(message))

    @endpoint(explicit_response_port=True)
    async def drop(self, port: Port[int]) -> None:
        pass

    @endpoint(explicit_response_port=True)
    async def escape(self, port: Port[int]) -> None:
        raise ValueError("escaped the port")


class ThreadBound(Actor):
    """Sets thread-local state in its constructor, as a training actor does."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.local = threading.local()
        self.local.value = "set in __init__"
        import torch

        torch.set_grad_enabled(False)

    @endpoint
    def observe(self) -> tuple[bool, str | None, bool]:
        import torch

        return (
            threading.get_ident() == self.thread,
            getattr(self.local, "value", None),
            torch.is_grad_enabled(),
        )

    @endpoint
    def slow(self, seconds: float) -> bool:
        time.sleep(seconds)
        return threading.get_ident() == self.thread


class Identity(Actor):
    """Reports who it is."""

    @endpoint
    def whoami(self) -> str:
        return current_actor_name()

    @endpoint
    def instance(self) -> dict:
        ins = context().actor_instance
        return {
            "rank": ins.rank.rank,
            "actor_id": str(ins.actor_id),
            "actor_name": ins.actor_id.actor_name,
            "name": ins.name,
            "class_name": ins.class_name,
            "proc_id": ins.proc_id,
            "repr": repr(ins),
            "creator": ins.creator,
            "proc_mesh_pids": ins.proc_mesh.pids,
        }

    @endpoint
    def spawn_child(self) -> Any:
        """A helper spawned by this actor on its own proc mesh: its creator is this actor."""
        return context().actor_instance.proc_mesh.slice(procs=0).spawn("child", Identity)

    @endpoint
    def helper_pid(self) -> tuple[int, int]:
        helper = context().actor_instance.proc.spawn("helper", Identity)
        return os.getpid(), helper.pid.call_one().get(timeout=30)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def abort(self, reason: str | None) -> str:
        context().actor_instance.abort(reason)
        return "aborted"


class Exiter(Actor):
    """Ends itself the ways a process would end."""

    @endpoint
    def exit(self, code: int) -> None:
        sys.exit(code)

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def fail(self) -> None:
        raise ValueError("the child broke")

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class AsyncExiter(Actor):
    """The same, async."""

    @endpoint
    async def interrupt(self) -> None:
        await asyncio.sleep(0)
        raise KeyboardInterrupt

    @endpoint
    async def aping(self) -> str:
        return "apong"


class Watcher(Actor):
    """Owns a child mesh and waits, inside an endpoint, for `__supervise__` to see it fail."""

    def __init__(self) -> None:
        self.failed = asyncio.Event()
        self.failed_sync = threading.Event()
        self.failures: list[MeshFailure] = []
        self.lock = threading.Lock()
        self.procs = None
        self.children = None

    def _spawn_children(self, exits: bool) -> int:
        self.procs = this_host().spawn_procs(per_host={"procs": 1}, name="watched")
        self.children = self.procs.spawn("kid", Exiter)
        if exits:
            self.children.exit.broadcast(3)
        return self.procs.pids[0]

    @endpoint
    def spawn_children(self, exits: bool) -> int:
        return self._spawn_children(exits)

    @endpoint
    def wait_sync(self, timeout: float) -> str:
        if not self.failed_sync.wait(timeout):
            raise TimeoutError("__supervise__ did not run while this endpoint waited")
        return self.failures[0].kind

    @endpoint
    def seen(self) -> list[MeshFailure]:
        with self.lock:
            return list(self.failures)

    def __supervise__(self, failure: MeshFailure) -> bool:
        with self.lock:
            self.failures.append(failure)
        self.failed.set()  # runs on the proc's event loop: an asyncio.Event may be set here
        self.failed_sync.set()
        return True


class AsyncWatcher(Actor):
    """The same with async endpoints (and a sync `__supervise__`, which Monarch allows)."""

    __init__ = Watcher.__init__
    _spawn_children = Watcher._spawn_children
    __supervise__ = Watcher.__supervise__

    @endpoint
    async def spawn_children(self, exits: bool) -> int:
        return await asyncio.to_thread(self._spawn_children, exits)

    @endpoint
    async def wait_async(self, timeout: float) -> str:
        await asyncio.wait_for(self.failed.wait(), timeout)
        return self.failures[0].kind


class Adopter(Actor):
    """Spawns a child on procs it was handed (their owner is the controller) and waits, inside
    an endpoint, for its own `__supervise__` to hear of the child's failure (Monarch's
    SuperviseExceptionParent): the actor mesh's owner is who spawned it."""

    def __init__(self) -> None:
        self.failures: list[MeshFailure] = []
        self.failed = asyncio.Event()

    @endpoint
    async def fail_child(self, procs, how: str, timeout: float) -> list[MeshFailure]:
        child = procs.spawn("adopted", Exiter)
        pid = await child.pid.call_one()
        if how == "raise":
            child.fail.broadcast()
        elif how == "exit":
            child.exit.broadcast(3)
        else:
            os.kill(pid, signal.SIGKILL)
        await asyncio.wait_for(self.failed.wait(), timeout)
        return self.failures

    def __supervise__(self, failure: MeshFailure) -> bool:
        self.failures.append(failure)
        self.failed.set()
        return True


class AsyncSuperviseWatcher(AsyncWatcher):
    """The same, with an async `__supervise__`."""

    async def __supervise__(self, failure: MeshFailure) -> bool:  # type: ignore[override]
        await asyncio.sleep(0)
        return Watcher.__supervise__(self, failure)


class Log(Actor):
    """Where the actors below report what ran (lines, in order of arrival)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    @endpoint
    def add(self, line: str) -> None:
        self.lines.append(line)

    @endpoint
    def read(self) -> list[str]:
        return list(self.lines)


class Cleaned(Actor):
    """A sync actor whose __cleanup__ reports its argument and the thread it runs on."""

    def __init__(self, log, tag: str) -> None:
        self.log = log
        self.tag = tag
        self.thread = threading.current_thread().name

    @endpoint
    def ping(self) -> str:
        return "pong"

    @endpoint
    def abort(self, reason: str) -> None:
        context().actor_instance.abort(reason)

    def __cleanup__(self, exc: Exception | None) -> None:
        same_thread = threading.current_thread().name == self.thread
        self.log.add.call_one(f"{self.tag} cleanup exc={exc} same_thread={same_thread}").get()


class AsyncCleaned(Actor):
    """Monarch's ConcurrentEndpointCleanupOrder: a running concurrent endpoint is cancelled,
    and its `finally` has run, before the async __cleanup__."""

    def __init__(self, log) -> None:
        self.log = log
        self.unblock = asyncio.Event()

    @concurrent_endpoint(explicit_response_port=True)
    async def run(self, port: Port[str]) -> None:
        port.send("started")
        try:
            await self.unblock.wait()
        finally:
            await self.log.add.call_one("task ended")

    async def __cleanup__(self, exc: Exception | None) -> None:
        await self.log.add.call_one(f"cleanup exc={exc}")


class _WritesWhenFinalized:
    def __init__(self, path: str) -> None:
        # opened now: `open` is gone at interpreter finalization
        self.file = open(path, "w")  # noqa: SIM115

    def __del__(self) -> None:
        self.file.write("finalized")
        self.file.close()


_finalized_at_exit: _WritesWhenFinalized | None = None


class NeverReady(Actor):
    """Its constructor never returns (Monarch's RunForeverOnInitActor)."""

    def __init__(self) -> None:
        threading.Event().wait()

    @endpoint
    def ping(self) -> str:
        return "pong"


class Finalized(Actor):
    """Leaves a module global whose `__del__` writes `path` and an `atexit` handler that writes
    `path.atexit`: both run only if the proc exits as Python exits (Monarch's
    test_del_runs_on_proc_mesh_stop)."""

    def __init__(self, path: str) -> None:
        global _finalized_at_exit
        import atexit

        _finalized_at_exit = _WritesWhenFinalized(path)
        atexit.register(lambda: open(path + ".atexit", "w").close())

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Owner(Actor):
    """Owns a proc mesh of its own and an actor mesh on procs it was given (Monarch's
    WrapperActor); defines no __cleanup__: what it owns is stopped anyway."""

    def __init__(self, procs, log) -> None:
        self.own_procs = this_host().spawn_procs(per_host={"procs": 1})
        self.on_own = self.own_procs.spawn("on-own", Cleaned, log, "on-own")
        self.on_given = procs.spawn("on-given", Cleaned, log, "on-given")

    @endpoint
    def own_pids(self) -> list[int]:
        return self.own_procs.pids


class Producer(Actor):
    """Sends values to a channel's port it was given (Monarch's cookbook fan-in)."""

    @endpoint
    async def produce(self, port: Port[int], n: int) -> None:
        rank = context().actor_instance.rank.rank
        for step in range(n):
            port.send(rank * 10 + step)

    @endpoint
    async def produce_later(self, port: Port[int], n: int) -> None:
        rank = context().actor_instance.rank.rank

        async def stream() -> None:
            for step in range(n):
                port.send(rank * 10 + step)

        self.task = asyncio.create_task(stream())  # sends after the endpoint returned

    @endpoint
    async def fail(self, port: Port[int]) -> None:
        port.exception(ValueError("no data"))

    @endpoint
    async def collect(self, producers, n: int) -> list[int]:
        """Opens a channel here (an actor's own mailbox), fans the producers in."""
        from raymesh import Channel

        port, receiver = Channel[int].open()
        producers.produce_later.broadcast(port, n)
        return sorted([await receiver.recv() for _ in range(len(producers) * n)])


class Squarer(Actor):
    """Replies for Monarch's `send` (to a port, or to nobody)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def square(self, x: int) -> int:
        self.seen.append(x)
        if x < 0:
            raise ValueError(f"{x} is negative")
        return x * x + context().actor_instance.rank.rank

    @endpoint
    def history(self) -> list[int]:
        return list(self.seen)


class Named(Actor):
    @endpoint
    async def whoami(self) -> str:
        return current_actor_name()


class Streamer(Actor):
    """Streams from actors that may share its proc's event loop (Monarch's From/To)."""

    @endpoint
    async def fetch(self, named) -> list[str]:
        return [await f for f in named.whoami.stream()]
