"""The local runtime's warm procs, shared by the programs that attach to it.

`raymesh up` keeps warm procs that outlive programs: `Broker`, a named actor of the runtime's
daemon, starts them (so they live as long as the runtime, whoever adopts them) and hands them
out; a program attached to the runtime takes them through `claim` where `pool.take` would take
its own. What stays true for such a proc, beyond `pool`'s guarantees:
- It belongs to the program that adopted it, and to no other: it is handed out once, and it
  ends when that program ends, however it ends (its host watches the program's process, by pid
  and start time, and exits once it is gone: a SIGKILLed program leaves no proc behind).
- It runs the program's code as the program's own procs would: adopted with the program's
  `sys.path`, working directory and environment (`Origin`).
- The runtime refills the pool after each claim once its host has had a core idle for a while
  (`host_agent.REFILL_IDLE`, or after `REFILL_WAIT_S`), as `pool` does: new procs started at once
  would take the CPUs of the program that just claimed (a training job's first step came 1.5 s
  later on 2 cores). Its procs import at the lowest CPU priority as `pool`'s do.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import psutil
import ray

from raymesh._src.backend.host_agent import REFILL_IDLE, REFILL_WAIT_S, wait_idle
from raymesh._src.backend.proc_host import ProcHost
from raymesh._src.backend.runtime_file import NAMESPACE

BROKER = "warm-broker"
CLAIM_TIMEOUT_S = 30.0
# Not carried to a proc: Ray's own settings for the process it started, and the shell's.
_NOT_CARRIED = ("RAY_", "_", "PWD", "OLDPWD", "SHLVL")


@dataclass(frozen=True)
class Origin:
    """The program a shared warm proc is adopted by: who to outlive never (pid and start
    time), what its procs would have seen had it started them (sys.path, cwd, env), and its
    Ray job (the proc itself is a worker of the runtime's job)."""

    pid: int
    started: float
    sys_path: tuple[str, ...]
    cwd: str
    job: str  # its Ray job's id and namespace: where its named actors are (`registry`)
    namespace: str
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def here(cls) -> Origin:
        env = {k: v for k, v in os.environ.items() if not k.startswith(_NOT_CARRIED)}
        me, ctx = psutil.Process(), ray.get_runtime_context()
        return cls(
            me.pid,
            me.create_time(),
            tuple(sys.path),
            os.getcwd(),
            ctx.get_job_id(),
            ctx.namespace,
            env,
        )

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).create_time() == self.started
        except psutil.Error:
            return False


class _Broker:
    """Keeps `size` warm procs on its node and hands them out, ready ones first."""

    def __init__(self, size: int, imports: tuple[str, ...]) -> None:
        self.size, self.imports = size, imports
        self.node_id = ray.get_runtime_context().get_node_id()
        self.warm: deque[tuple[Any, Any]] = deque()  # (handle, ref of handle.info())
        self.claimed = 0
        self._lock = threading.Lock()
        self._refilling = False
        self._fill()

    def _refill_when_idle(self) -> None:
        wait_idle(*REFILL_IDLE, REFILL_WAIT_S)
        with self._lock:
            self._refilling = False
            self._fill()

    def _fill(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        while len(self.warm) < self.size:
            handle = ProcHost.options(
                num_cpus=0,
                scheduling_strategy=NodeAffinitySchedulingStrategy(self.node_id, soft=False),
            ).remote(None, None, None, self.imports)
            self.warm.append((handle, handle.info.remote()))

    def claim(self, n: int) -> list[Any]:
        """Up to `n` warm procs (handles), the ready ones first; the pool is refilled once the
        host is idle."""
        with self._lock:
            infos = [info for _, info in self.warm]
            ready, _ = ray.wait(infos, num_returns=len(infos), timeout=0, fetch_local=False)
            ready_set = set(ready)
            ordered = sorted(self.warm, key=lambda w: w[1] not in ready_set)
            taken = ordered[: max(0, n)]
            self.warm = deque(ordered[len(taken) :])
            self.claimed += len(taken)
            if taken and not self._refilling:
                self._refilling = True
                threading.Thread(target=self._refill_when_idle, daemon=True).start()
        return [handle for handle, _ in taken]

    def status(self) -> dict[str, Any]:
        with self._lock:
            infos = [info for _, info in self.warm]
        ready, _ = ray.wait(infos, num_returns=len(infos), timeout=0, fetch_local=False)
        return {"size": self.size, "ready": len(ready), "warm": len(infos), "claimed": self.claimed}

    def ready(self) -> bool:
        return True


Broker: Any = ray.remote(num_cpus=0)(_Broker)


def start_broker(size: int, imports: tuple[str, ...]) -> Any:
    """The runtime's broker (called by the daemon, which then owns it and its procs)."""
    broker = Broker.options(name=BROKER, namespace=NAMESPACE).remote(size, imports)
    ray.get(broker.ready.remote(), timeout=120)
    return broker


def broker() -> Any | None:
    """The attached runtime's broker, or None when it has none (the pool is off)."""
    try:
        return ray.get_actor(BROKER, namespace=NAMESPACE)
    except ValueError:
        return None


def claim(n: int) -> list[Any]:
    """Up to `n` of the runtime's warm procs for this program (none if it keeps none)."""
    b = broker()
    if b is None or n <= 0:
        return []
    return list(ray.get(b.claim.remote(n), timeout=CLAIM_TIMEOUT_S))
