"""Warm procs: proc hosts started ahead of the spawns that will use them.

Starting a proc costs a Python process, Ray's core worker, raymesh's and torch's imports:
seconds on a small machine, and Ray starts workers only about one per core at a time. A warm
proc pays all of that while nobody waits for it; `spawn_procs` then adopts it in a round trip.

What stays true for a proc that was warm:
- One OS process per proc, never reused: a warm proc joins one mesh, and dies with it.
- The mesh's resources are reserved exactly as for a cold proc, by its placement group bundle on
  the same node; the warm process runs beside its bundle, not inside it. While it waits, a warm
  proc reserves nothing (`num_cpus=0`), so an idle pool never holds CPUs or GPUs that other Ray
  jobs need; it holds memory (one Python process with torch imported, about 0.35 GB resident;
  0.39 GB with what `raymesh.train` preloads).
- GPU procs never come from the pool: Ray gives a process its GPU (`CUDA_VISIBLE_DEVICES`) only
  when it schedules that process onto a GPU, so they start cold.
- Only the controller keeps a pool. A Ray actor dies with the process that created it, so a warm
  proc adopted by a mesh that an actor spawned would outlive that actor; nested meshes start cold.
- Supervision is unchanged: the host agent watches the adopted process's pid like any other.

`RAYMESH_WARM_PROCS` (default 8; 0 turns the pool off) is the most warm procs the controller
keeps on one node: that many on its own node from the moment it connects to Ray, and on another
node as many as the largest spawn there has asked for (so a job that puts one rank per node
keeps one warm proc per node). A spawn takes the ready ones first, then ones still starting
(never slower than starting a new one), starts the rest cold, and, once its procs are up and
their host has had a core idle for a while (`host_agent.REFILL_IDLE`, or after `REFILL_WAIT_S`
regardless), tops the pool up; a host left with no warm proc gets one back at once (`reserve`: a
self-healing job's next replacement). Warm procs import at the lowest CPU priority (see
`proc_host._preload`), so a refill beside a running job slows it less; what they import is
`imports()` (`RAYMESH_PRELOAD` replaces it).
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from raymesh._src.backend import runtime, shared_pool
from raymesh._src.backend.proc_host import ProcHost

DEFAULT_SIZE = 8
_lock = threading.Lock()
_warm: dict[str, deque[WarmProc]] = {}  # node id -> warm procs, oldest first
_targets: dict[str, int] = {}  # node id -> warm procs to keep there
_fillers: list[threading.Thread] = []  # fills waiting for their `after`
_stopping = threading.Event()  # tells them to give up (see `drain`)
_imports: list[str] = []  # what warm procs import beyond PRELOAD (see `preload`)

# What every warm proc imports while it waits: each costs seconds on a small machine, and nearly
# every proc of a torch program needs them (any tensor argument, any training rank). `preload`
# adds to it (raymesh.train adds what a training rank imports); `RAYMESH_PRELOAD` replaces all.
PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel")


@dataclass(frozen=True)
class WarmProc:
    handle: Any
    info: Any  # the ref of handle.info(): resolved once the proc is ready
    origin: Any = None  # a `shared_pool.Origin` to adopt it with: the local runtime's proc


def size() -> int:
    """Warm procs to keep per node (`RAYMESH_WARM_PROCS`)."""
    raw = os.environ.get("RAYMESH_WARM_PROCS", str(DEFAULT_SIZE))
    try:
        n = int(raw)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(
            f"RAYMESH_WARM_PROCS={raw!r}: must be an int >= 0 (warm procs kept per node; "
            "0 turns the pool off)"
        )
    return n


def check() -> None:
    """Raise ValueError, naming the variable, the value and the fix, for a bad
    `RAYMESH_WARM_PROCS` or `RAYMESH_PRELOAD`: before a spawn starts anything."""
    if size() > 0:
        imports()


def is_module_name(name: object) -> bool:
    """Whether `name` is a dotted module name (what `preload` and `RAYMESH_PRELOAD` take)."""
    return isinstance(name, str) and all(part.isidentifier() for part in name.split("."))


def preload(modules: tuple[str, ...]) -> None:
    """Have warm procs started from now on also import `modules` while they wait."""
    with _lock:
        _imports.extend(m for m in modules if m not in _imports)


def imports() -> tuple[str, ...]:
    """What warm procs import while they wait: `RAYMESH_PRELOAD` where it is set (the whole
    list), else `PRELOAD` and what `preload` added. Set empty, for procs that never use torch,
    it saves each warm proc 0.8 CPU-seconds to start (1.6 with what `raymesh.train` adds;
    bench/proc_start.py on 2 cores) and about 0.25 GB."""
    raw = os.environ.get("RAYMESH_PRELOAD")
    if raw is None:  # (no lock: `_start` calls this holding it; a list's copy is atomic)
        return PRELOAD + tuple(m for m in list(_imports) if m not in PRELOAD)
    modules = tuple(m.strip() for m in raw.split(",") if m.strip())
    for m in modules:
        if not is_module_name(m):
            raise ValueError(
                f"RAYMESH_PRELOAD={raw!r}: {m!r} is not a module name; give dotted module names "
                "separated by commas (e.g. 'torch,transformers'), or set it empty for none"
            )
    return modules


def _in_controller() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().worker.mode == ray.SCRIPT_MODE


def fill(counts: Mapping[str, int], after: Any = None, *, untouched_only: bool = False) -> None:
    """Keep warm procs on each node of `counts`: as many as the largest count asked for there
    so far (a spawn of k procs asks for k), at most `size()`. Does not wait for them.

    With `after` (an object ref), a thread starts them once it resolves. `untouched_only`: then
    only on nodes no spawn has asked for procs yet (a spawn that found the pool empty starts its
    procs cold and tops the pool up itself once they are up; warm procs started beside them
    would only slow them down)."""
    limit = size()
    if limit == 0 or not _in_controller() or runtime.attached() is not None:
        return  # (attached to the local runtime: it keeps the warm procs)
    check()  # in the caller, not in a filling thread
    if after is not None:
        ready = after.future()  # resolved by Ray; this thread never calls into Ray to wait

        def then_fill() -> None:
            # Short waits and no Ray call until the fill: the user may shut Ray down meanwhile,
            # and a thread inside a Ray call then makes Ray end the process with an error.
            deadline = time.monotonic() + 300
            while not _stopping.is_set() and time.monotonic() < deadline:
                if concurrent.futures.wait([ready], timeout=0.25).done:
                    break
            if _stopping.is_set() or not ray.is_initialized():
                return
            with _lock:
                todo = {n: k for n, k in counts.items() if not (untouched_only and n in _warm)}
            fill(todo)

        thread = threading.Thread(target=then_fill, name="raymesh-warm-procs", daemon=True)
        _fillers.append(thread)
        thread.start()
        return
    with _lock:
        for node_id, count in counts.items():
            target = _targets[node_id] = max(_targets.get(node_id, 0), min(count, limit))
            _start(node_id, target)


def reserve(node_id: str) -> None:
    """Start one warm proc on `node_id` now if it has none left (without raising its target):
    the replacement a self-healing job will ask for next, even while its host stays busy."""
    if size() == 0 or not _in_controller() or runtime.attached() is not None:
        return
    with _lock:
        _start(node_id, 1)


def _start(node_id: str, target: int) -> None:
    """Start warm procs on `node_id` until it has `target` (the caller holds `_lock`)."""
    warm, modules = _warm.setdefault(node_id, deque()), imports()
    while len(warm) < target:
        handle = ProcHost.options(
            num_cpus=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(None, None, None, modules)
        warm.append(WarmProc(handle, handle.info.remote()))


def take(node_id: str, n: int) -> list[WarmProc]:
    """Up to `n` warm procs of `node_id`, the ready ones first (none while the pool is off)."""
    if n <= 0 or size() == 0 or not _in_controller():
        return []
    if runtime.attached() is not None:  # the local runtime's, adopted as this program's
        origin = shared_pool.Origin.here()
        return [WarmProc(h, h.info.remote(), origin) for h in shared_pool.claim(n)]
    with _lock:
        warm = _warm.setdefault(node_id, deque())  # a spawn has asked here (see `fill`)
        if not warm:
            return []
        infos = [w.info for w in warm]
        ready, _ = ray.wait(infos, num_returns=len(infos), timeout=0, fetch_local=False)
        ready_set = set(ready)
        ordered = sorted(warm, key=lambda w: w.info not in ready_set)
        warm.clear()
        warm.extend(ordered[n:])
        return ordered[:n]


def _stop_fillers() -> None:
    _stopping.set()
    for thread in list(_fillers):
        thread.join(timeout=5.0)
    _fillers.clear()
    _stopping.clear()


runtime.before_shutdown(_stop_fillers)  # a fill calls into Ray


def drain() -> None:
    """End every warm proc and pending refill (before Ray shuts down, or to free memory)."""
    _stop_fillers()
    with _lock:
        procs = [w for warm in _warm.values() for w in warm]
        _warm.clear()
        _targets.clear()
    for w in procs:
        try:
            ray.kill(w.handle, no_restart=True)
        except Exception:
            pass


runtime.on_shutdown(drain)


def wait_ready(timeout: float) -> bool:
    """Wait until every warm proc has started; False if some have not within `timeout`."""
    deadline = time.monotonic() + timeout
    for thread in list(_fillers):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
        if thread in _fillers:  # (drain may have cleared the list meanwhile)
            _fillers.remove(thread)
    timeout = max(0.0, deadline - time.monotonic())
    with _lock:
        infos = [w.info for warm in _warm.values() for w in warm]
    if not infos:
        return True
    _, pending = ray.wait(infos, num_returns=len(infos), timeout=timeout, fetch_local=False)
    return not pending
