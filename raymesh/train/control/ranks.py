"""The rank pool: a job's ranks, its warm spares, and the recruiter that finds more.

Each rank is a proc of its own (with its own placement group, so stopping a lost rank frees
exactly its resources) holding a `TrainWorker` and, beside it, a `Monitor`. The pool spawns
ranks concurrently, keeps spares warm (built nothing, gloo loaded), hands out replacements
(spares first, then new procs wherever there is room), and runs a background recruiter while
the job wants more procs than it has: spawning takes seconds, so it stays off the training
path. The controller owns the world (`RankPool.ranks`); the recruiter only adds spares.

Given `WarmRanks` (procs kept between jobs), the pool takes its first ranks from there, each
with a new trainer for this job, and gives its live ranks back when the job ends cleanly.

The controller is given its pool (`TrainController.create` makes this one; a unit test gives
it a fake).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from raymesh.actor import PlacementError, ProcMesh, host_mesh, this_host
from raymesh.train.config import TrainConfig
from raymesh.train.control.member import Rank
from raymesh.train.control.placement import Placer
from raymesh.train.control.warm import WarmRanks
from raymesh.train.rank.monitor import Monitor
from raymesh.train.rank.worker import TrainWorker

logger = logging.getLogger("raymesh")

__all__ = ["RankPool"]


class RankPool:
    """A job's ranks and spares (see the module docstring)."""

    def __init__(
        self,
        build: Any,
        config: TrainConfig,
        placer: Placer,
        warm: WarmRanks | None = None,
        *,
        driven: bool = False,
    ) -> None:
        self.build = build
        self.config = config
        self.driven = driven  # a job its loop drives (train.drive): its trainers are told
        self.placer = placer
        self.warm = warm
        self.shape = (config.cpus_per_worker, placer.gpus)  # which warm ranks this job takes
        self.ranks: list[Rank] = []  # the world, in rank order (set by the controller)
        self.spares: list[Rank] = []
        self.lock = threading.Lock()  # spares, claimed and procs, shared with the recruiter
        self.claimed = 0  # spares taken for a reshape that has not finished
        self.procs: list[ProcMesh] = []  # every proc mesh spawned, to stop them all at the end
        self.names = itertools.count()
        self.recruiter: threading.Thread | None = None
        self.stopping = threading.Event()
        self.hosts: dict[str, str] = {}  # node id -> "hostname (ip)", for `snapshot`

    # ---- the world -----------------------------------------------------------------------
    def set_world(self, ranks: list[Rank]) -> None:
        """`ranks` are the world now (the spares claimed for it are ranks)."""
        with self.lock:
            self.ranks = ranks
            self.claimed = 0

    def ready(self) -> int:
        """Spares ready to join."""
        with self.lock:
            return len(self.spares)

    def snapshot(self) -> dict[str, Any]:
        """The world's procs and the spares' as plain data (`Rank.describe`), with each host's
        name and address (asked of the cluster once per host the job has not seen before)."""
        with self.lock:
            ranks, spares = list(self.ranks), list(self.spares)
        if any(r.node_id not in self.hosts for r in ranks + spares):
            hosts = host_mesh()
            for node, name, ip in zip(hosts.node_ids, hosts.hostnames, hosts.addresses):
                self.hosts[node] = f"{name} ({ip})" if name else ip
        return {
            "ranks": [r.describe(i, self.hosts) for i, r in enumerate(ranks)],
            "spares": [r.describe(None, self.hosts) for r in spares],
        }

    # ---- spawning ------------------------------------------------------------------------
    def spawn(
        self, n: int, name: str, *, nodes: list[str] | None = None, timeout: float | None = None
    ) -> list[Rank]:
        """`n` new ranks (not yet in the process group) on `nodes` (default: where there is
        room, this host first; ranks without a node wait for room on this host, up to the
        timeout). Spawned concurrently; if one cannot be placed, the others are stopped and
        PlacementError raised."""
        if n == 0:
            return []
        nodes = list(self.placer.pick_nodes(n) if nodes is None else nodes)
        nodes += [this_host().node_ids[0]] * (n - len(nodes))
        timeout = self.config.timeout_s if timeout is None else timeout
        with ThreadPoolExecutor(n) as pool:
            futures = [
                pool.submit(self._spawn_one, f"{name}-{next(self.names)}", node, timeout)
                for node in nodes
            ]
        ranks, errors = [], []
        for f in futures:
            try:
                ranks.append(f.result())
            except Exception as e:
                errors.append(e)
        if errors:
            for r in ranks:
                r.stop()
            raise errors[0]
        return ranks

    def _spawn_one(self, name: str, node_id: str, timeout: float) -> Rank:
        procs = (
            host_mesh()
            .select_hosts([node_id])
            .spawn_procs(
                per_host={"gpus" if self.placer.gpus else "procs": 1},
                name=name,
                cpus_per_proc=self.config.cpus_per_worker,
                timeout=timeout,
                escalate=False,  # the controller heals its ranks' deaths itself
            )
        )
        with self.lock:
            self.procs.append(procs)
        if self.stopping.is_set():  # the job ended while this proc started
            procs.stop(timeout=10.0)
            raise PlacementError(f"{name}: the job ended while it started")
        try:
            worker = procs.spawn("trainer", TrainWorker, self.build, self.config, self.driven)
            monitor = procs.spawn("monitor", Monitor)
        except BaseException:
            procs.stop(timeout=10.0)
            raise
        return Rank(worker, monitor, procs, procs.node_ids[0])

    def take_warm(self, n: int) -> list[Rank]:
        """Up to `n` ranks from the warm ranks, each with a new trainer for this job (not yet
        in the process group), in the order of their nodes."""
        if self.warm is None or n == 0:
            return []
        out = []
        for rank in self.warm.take(n, self.shape):
            try:
                worker = rank.procs.spawn(
                    "trainer", TrainWorker, self.build, self.config, self.driven
                )
            except Exception as e:  # it died as it was taken: the job starts one instead
                logger.info("raymesh.train: a warm rank failed to take a trainer: %s", e)
                rank.stop()
                continue
            with self.lock:
                self.procs.append(rank.procs)
            out.append(Rank(worker, rank.monitor, rank.procs, rank.node_id))
        return sorted(out, key=lambda r: r.node_id)

    def spawn_spares(
        self, n: int, *, nodes: list[str] | None = None, timeout: float | None = None
    ) -> list[Rank]:
        """`n` warm spare ranks: spawned, built nothing yet, gloo already loaded."""
        spares = self.spawn(n, "spare", nodes=nodes, timeout=timeout)
        try:
            for f in [r.worker.warm.call_one() for r in spares]:
                f.get(timeout=self.config.timeout_s)
        except BaseException:
            for r in spares:
                r.stop()
            raise
        return spares

    def add_spares(self, n: int) -> None:
        """Spawn up to `n` spares where there is room now (the recruiter makes the rest)."""
        nodes = self.placer.pick_nodes(n)
        spares = self.spawn_spares(len(nodes), nodes=nodes)
        with self.lock:
            self.spares.extend(spares)

    def take_spares(self, n: int) -> list[Rank]:
        """Up to `n` live spares (dead ones are stopped and dropped). They count as claimed
        (not wanted again by the recruiter) until `set_world` makes them ranks."""
        out: list[Rank] = []
        dead: list[Rank] = []
        with self.lock:
            while self.spares and len(out) < n:
                spare = self.spares.pop(0)
                (out if spare.alive() else dead).append(spare)
            self.claimed += len(out)
        for spare in dead:
            spare.stop()
        return out

    def replacements(self, n: int, timeout: float) -> list[Rank]:
        """Up to `n` new ranks: warm spares first, then new procs wherever there is room,
        waiting up to `timeout` seconds for room (a lost node's resources may come back, or the
        recruiter may have a spare ready). Never longer: what could not be placed by then is
        left out, and the failure policy decides."""
        got = self.take_spares(n)
        deadline = time.monotonic() + timeout
        while len(got) < n:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            nodes = self.placer.pick_nodes(n - len(got))
            if nodes:
                try:
                    got += self.spawn(len(nodes), "trainer", nodes=nodes, timeout=remaining)
                except Exception as e:  # someone else took the room, or the proc failed
                    logger.info("raymesh.train: placing a replacement failed: %s", e)
                    time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))
            else:
                time.sleep(min(0.2, remaining))
            got += self.take_spares(n - len(got))
        return got

    # ---- the recruiter -------------------------------------------------------------------
    def recruit(self) -> None:
        """Make sure the recruiter runs while the job wants more procs than it has."""
        with self.lock:
            if self.recruiter is not None or self._wanted() <= 0:
                return
            self.recruiter = threading.Thread(
                target=self._recruit, name="raymesh-recruiter", daemon=True
            )
            self.recruiter.start()

    def _wanted(self) -> int:  # under self.lock
        cfg = self.config
        have = len(self.ranks) + len(self.spares) + self.claimed
        return cfg.spares + cfg.max_workers - have

    def _recruit(self) -> None:
        # Spawns ranks where there is room (all it can at once), else looks again every
        # grow_interval_s; new ranks wait as spares (Running grows from them, Healing takes them
        # first). It exits (under the lock, so recruit() can start a new one) when nothing is
        # wanted or the job ends.
        cfg = self.config
        while not self.stopping.is_set():
            with self.lock:
                wanted = self._wanted()
                if wanted <= 0:
                    self.recruiter = None
                    return
            try:
                nodes = self.placer.pick_nodes(wanted)
                ranks = self.spawn_spares(len(nodes), nodes=nodes, timeout=10.0) if nodes else []
            except Exception as e:
                if not self.stopping.is_set():  # (a spare cut short by the job's end is no news)
                    logger.info("raymesh.train: recruiting failed (will retry): %s", e)
                ranks = []
            if self.stopping.is_set():
                for r in ranks:
                    r.stop()
                return
            if ranks:
                with self.lock:
                    self.spares.extend(ranks)
                logger.info("raymesh.train: recruited %d rank(s)", len(ranks))
            else:
                self.stopping.wait(cfg.grow_interval_s)

    def close(self, *, reuse: bool = False) -> None:
        """Stop the recruiter, then every proc the pool spawned. `reuse` (the job ended
        cleanly, its ranks at a step boundary) with warm ranks: the live ranks and spares
        leave their process group, drop the job's state and go back to the warm ranks
        instead; one that does not answer is stopped."""
        self.stopping.set()
        recruiter = self.recruiter
        if recruiter is not None:
            recruiter.join(timeout=30.0)
        kept: list[Rank] = []
        if reuse and self.warm is not None:
            kept = self._release([r for r in self.ranks + self.spares if r.alive()])
        held = {id(r.procs) for r in kept}
        for procs in self.procs:
            if id(procs) in held:
                continue
            try:
                procs.stop()
            except Exception:
                logger.exception("raymesh.train: stopping trainer procs failed")
        if kept:
            assert self.warm is not None
            self.warm.give(kept, self.shape)

    def _release(self, ranks: list[Rank]) -> list[Rank]:
        """The ranks that left their job cleanly (see TrainWorker.release), trainers stopped."""
        futures = [(r, r.worker.release.call_one()) for r in ranks]
        out = []
        for rank, future in futures:
            try:
                future.get(timeout=30.0)
                rank.worker.stop()
            except Exception as e:
                logger.info("raymesh.train: %s not kept warm: %s", rank.procs.name, e)
                continue
            out.append(rank)
        return out
