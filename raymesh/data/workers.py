"""`Workers`: a pipeline's preprocessing procs, owned by the controller.

Each worker is a mesh of one proc (so that one can be added, removed or replaced alone),
placed by Ray on whichever host has free CPUs, not only the trainers' hosts. The controller
calls `tick()` between its own steps with the trainers' measured data wait: it replaces dead
workers, asks the scaling policy, and starts new procs on a thread of its own, so the trainers
(who hold batches ahead) do not wait for a spawn. Consumers learn the current set by
`generation`: `handles()` changes only when the generation does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from raymesh.actor import host_mesh
from raymesh.data.feed import Preprocessor, WorkerStats
from raymesh.data.pipeline import Pipeline
from raymesh.data.scaling import Scale, ScalePolicy

__all__ = ["PipelineReport", "Workers"]

logger = logging.getLogger("raymesh")

SPAWN_TIMEOUT_S = 120.0
STATS_TIMEOUT_S = 10.0
MAX_SPAWN_FAILURES = 3


@dataclass(frozen=True)
class PipelineReport:
    """What a pipeline did over a run (`train.Result.data`)."""

    workers: int  # preprocessing procs at the end
    peak_workers: int  # the most at any time
    wait_fraction: float  # the trainers' time waiting for batches, over their step time
    samples_per_s: float  # samples the preprocessing procs made per second, latest measure
    decisions: tuple[Scale, ...]  # each scaling decision, in order
    replaced: int  # workers that died and were replaced


@dataclass
class _Worker:
    procs: Any
    actor: Any
    last: WorkerStats | None = None


class Workers:
    """The preprocessing procs of one pipeline (see the module docstring)."""

    def __init__(self, pipe: Pipeline, seed: int, *, nice: int | None = None) -> None:
        """nice: the consumer's niceness, for workers that feed a process outside Ray (see
        `Preprocessor`); None: they keep Ray's worker niceness, as the trainers do."""
        self.pipe, self.seed, self.nice = pipe, seed, nice
        low, high = pipe.bounds
        self.policy = ScalePolicy(min=low, max=high)
        self.workers: list[_Worker] = []
        self.generation = 0
        self.decisions: list[Scale] = []
        self.replaced = 0
        self.spawn_failures = 0
        self._lock = threading.Lock()
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, "raymesh-data-spawn")
        self._spawning: concurrent.futures.Future | None = None
        self._waited = self._ran = 0.0  # trainers' data wait and step time since a decision
        self._total_waited = self._total_ran = 0.0
        self._since = time.monotonic()
        self._count = 0
        self.peak = 0
        self.samples_per_s = 0.0

    def start(self) -> None:
        """Start the minimum number of workers, on a thread: consumers make their batches
        themselves until the first is up (so the first batch never waits for a spawn)."""
        low = self.pipe.bounds[0]
        if low:
            host_mesh()  # connects to Ray (or starts it) here: ray.init wants the main thread
            self._spawning = self._spawner.submit(self._grow, low)

    def handles(self) -> list[Any]:
        with self._lock:
            return [w.actor for w in self.workers]

    @property
    def size(self) -> int:
        with self._lock:
            return len(self.workers)

    def observe(self, waited_s: float, ran_s: float) -> None:
        """The trainers' seconds waiting for data and seconds of steps, summed over ranks."""
        self._waited += waited_s
        self._ran += ran_s
        self._total_waited += waited_s
        self._total_ran += ran_s

    def tick(self) -> None:
        """Replace dead workers, then scale if the policy says so (at most once per
        `scale_interval_s`). Spawns run on a thread of their own; never blocks on one."""
        if self._spawning is not None and not self._spawning.done():
            return
        if self._spawning is not None and self._spawning.exception() is not None:
            # The consumers make their own batches meanwhile; a worker that cannot start
            # (its pipeline does not unpickle there, no room) is tried MAX_SPAWN_FAILURES times.
            self.spawn_failures += 1
            logger.warning(
                "raymesh.data: starting a preprocessing worker failed (%s)%s",
                str(self._spawning.exception()).splitlines()[0][:300],
                "; giving up on more" if self.spawn_failures >= MAX_SPAWN_FAILURES else "",
            )
        self._spawning = None
        if self.spawn_failures >= MAX_SPAWN_FAILURES:
            return
        dead = self._reap()
        if dead:
            self.replaced += dead
            self._spawning = self._spawner.submit(self._grow, dead)
            return
        if time.monotonic() - self._since < self.pipe.scale_interval_s or self._ran <= 0:
            return
        decision = self.policy.decide(
            workers=self.size,
            wait_fraction=self._waited / self._ran,
            busy_workers=self._busy(),
        )
        self._waited = self._ran = 0.0
        self._since = time.monotonic()
        if decision is None:
            return
        logger.info("raymesh.data: %s", decision.reason)
        self.decisions.append(decision)
        if decision.workers > self.size:
            self._spawning = self._spawner.submit(self._grow, decision.workers - self.size)
        else:
            with self._lock:
                gone = self.workers.pop()
                self.generation += 1
            gone.procs.stop()  # its batches in flight are redone by the feeds

    def figures(self) -> dict[str, float]:
        """What a report row shows of the pipeline now."""
        return {"data_workers": self.size, "data_samples_per_s": round(self.samples_per_s, 1)}

    def report(self) -> PipelineReport:
        return PipelineReport(
            workers=self.size,
            peak_workers=self.peak,
            wait_fraction=self._total_waited / self._total_ran if self._total_ran else 0.0,
            samples_per_s=self.samples_per_s,
            decisions=tuple(self.decisions),
            replaced=self.replaced,
        )

    def stop(self) -> None:
        self._spawner.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            workers, self.workers = self.workers, []
        for w in workers:
            try:
                w.procs.stop().get(timeout=30)
            except Exception:
                logger.warning("raymesh.data: stopping a preprocessing worker failed")

    def _spawn(self) -> _Worker:
        hosts = host_mesh()
        free = hosts.free_procs(cpus_per_proc=self.pipe.cpus_per_worker)
        # The host with the most room (ties: the controller's own, first in the mapping);
        # when none has room now, the controller's host, where Ray queues the proc.
        node = max(free, key=lambda n: free[n]) if free else hosts.node_ids[0]
        self._count += 1
        procs = hosts.select_hosts([node]).spawn_procs(
            {"procs": 1},
            name=f"data{self._count}",
            cpus_per_proc=self.pipe.cpus_per_worker,
            timeout=SPAWN_TIMEOUT_S,
            escalate=False,  # this pool watches its workers (tick), and replaces them
        )
        actor = procs.spawn("preprocess", Preprocessor, self.pipe, self.seed, self.nice)
        return _Worker(procs, actor)

    def _grow(self, n: int) -> None:
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            for worker in pool.map(lambda _: self._spawn(), range(n)):
                with self._lock:
                    self.workers.append(worker)
                    self.generation += 1
                    self.peak = max(self.peak, len(self.workers))

    def _reap(self) -> int:
        with self._lock:
            dead = [w for w in self.workers if w.procs.failure is not None]
            if not dead:
                return 0
            self.workers = [w for w in self.workers if w not in dead]
            self.generation += 1
        for w in dead:
            logger.warning(
                "raymesh.data: preprocessing worker lost (%s); starting a replacement",
                str(w.procs.failure).splitlines()[0][:200],
            )
        return len(dead)

    def _busy(self) -> float:
        """The workers' busy seconds since the last look, over the wall time since then."""
        with self._lock:
            workers = list(self.workers)
        futures = [(w, w.actor.stats.call_one()) for w in workers]
        busy = wall = 0.0
        made = 0
        for w, f in futures:
            try:
                now: WorkerStats = f.get(timeout=STATS_TIMEOUT_S)
            except Exception:
                continue  # it died meanwhile: the next tick replaces it
            if w.last is not None:
                busy += now.busy_s - w.last.busy_s
                made += now.samples - w.last.samples
                wall = max(wall, now.up_s - w.last.up_s)
            w.last = now
        if wall <= 0:
            return float("inf")  # no baseline yet: not idle
        self.samples_per_s = made / wall
        return busy / wall
