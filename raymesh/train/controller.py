"""The training controller: an explicit state machine, driven from the user's process.

    Starting --> Running --> Finishing --> Finished
                 |  ^  ^
                 v  |  |
           Healing  Resizing              (and any state --> Failed on an unrecoverable error)

Each state is a small class whose `next(controller)` does one phase and returns the next state;
every transition is logged with its reason and kept in `Result.transitions`. Decisions come from
policy objects as data (`StrategyPolicy`: DDP or FSDP; `FailurePolicy`: replace, shrink, abort)
and the states carry them out.

Reporting stays off the critical path: a `run` call trains `report_every` steps and returns
their metrics, and the controller keeps the next call queued behind the running one, so the
ranks never wait for the controller between chunks.

Healing (DDP): when a rank dies (or raises, or hangs and is killed), the survivors abandon the
step in flight and leave their process group; the lost ranks are replaced by warm spares or new
procs; all ranks form the next generation of the process group; the survivor that completed
the most steps sends its model and optimizer state to every rank; training resumes at the first
step not completed. At most the step in flight is lost, and since the data order depends only
on the step, the final weights equal an uninterrupted run's at the same world size.
FSDP ranks hold only shards, so an FSDP job heals from its newest checkpoint instead: every rank
rebuilds (in its warm process) and loads it, resharded for the new world.

Elastic (`workers=(min, max)`): a lost rank that cannot be replaced within `replace_timeout_s`
is dropped and the job continues with fewer ranks (never below min), with the same global batch
split among them. A background recruiter keeps looking for capacity (and refills the warm
spares); when it has ranks ready, Running drains its chunks at a step boundary and Resizing
grows the world back. Each rank is its own proc and placement group, so stopping a lost rank
frees exactly its resources.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raymesh._src import backend
from raymesh._src.errors import ActorError, SupervisionError
from raymesh._src.proc_mesh import HostMesh, ProcMesh
from raymesh.testing.faults import Fault
from raymesh.topology.planner import Placement
from raymesh.train.balance import BalancePolicy
from raymesh.train.checkpoint import Checkpointer, Manifest
from raymesh.train.config import TrainConfig
from raymesh.train.data import split_sizes
from raymesh.train.failure import (
    FailureDecision,
    FailurePolicy,
    FailureRecord,
    GrowPolicy,
    TooManyFailures,
)
from raymesh.train.strategy import (
    MemoryEstimate,
    StrategyDecision,
    StrategyPolicy,
    host_shard_size,
    splits_into_shard_groups,
)
from raymesh.train.task import local_ranks
from raymesh.train.worker import Monitor, TrainWorker

logger = logging.getLogger("raymesh")

__all__ = ["Result", "TrainController", "TrainError"]

# After one rank of a chunk has failed, how long the others may take to report before they count
# as stuck (survivors normally fail within milliseconds, when their peer's sockets close).
HEAL_GRACE_S = 5.0


class TrainError(RuntimeError):
    """The job stopped. `cause` is the underlying failure; `history` what was trained."""

    def __init__(self, message: str, *, cause: BaseException | None, history: list[dict]) -> None:
        super().__init__(message)
        self.cause = cause
        self.history = history


class WorldBroken(Exception):
    """Ranks were lost while the world re-formed (internal: the controller heals again)."""

    def __init__(self, lost: list[tuple[int, str, str]], state: dict[str, Any] | None) -> None:
        super().__init__("; ".join(f"rank {i}: {kind}: {cause}" for i, kind, cause in lost))
        self.lost = lost  # (rank, kind, cause)
        self.state = state  # the DDP state fetched before it broke, kept for the next try


@dataclass
class Result:
    """What `fit` returns."""

    # One entry per step: step (1-based), loss (mean of ranks), samples_per_s, end (wall time
    # the step was complete on every rank).
    history: list[dict[str, float]]
    decision: StrategyDecision  # the strategy and its arithmetic
    checkpoint: str | None  # the newest committed checkpoint folder, if checkpoints were on
    resumed_from: int  # the step the run started from (0: fresh)
    transitions: list[tuple[str, str]]  # (state, reason), in order
    failures: list[FailureRecord] = field(default_factory=list)  # and how each was healed
    # Each rebalance (rebalance=True): {"step", "sizes", "flagged", "reason"}
    rebalances: list[dict[str, Any]] = field(default_factory=list)
    placement: str | None = None  # why the ranks run where they do (multi-host: the plan)
    _weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final model weights: CPU tensors under the model's own (unwrapped) names."""
        return dict(self._weights)


@dataclass(eq=False)
class Rank:
    """One member of the world (or a spare): its trainer, the monitor beside it, its proc."""

    worker: Any  # ActorMesh of one TrainWorker
    monitor: Any  # ActorMesh of one Monitor, on the same proc
    procs: ProcMesh  # a mesh of this one proc, with its own placement group
    pid: int
    node_id: str

    def alive(self) -> bool:
        return self.procs._state.check((0,), None) is None

    def stop(self) -> None:
        """End the proc and release its resources (it may already be dead)."""
        try:
            self.procs.stop(timeout=10.0)
        except Exception as e:  # its resources are released either way
            logger.debug("raymesh.train: stopping %s: %s", self.procs.name, e)


class State:
    name = "State"

    def next(self, c: TrainController) -> State:
        raise NotImplementedError


class Starting(State):
    """Spawn one proc and trainer per rank (and the spares), form the process group, build,
    decide the strategy, restore a checkpoint."""

    name = "Starting"

    def next(self, c: TrainController) -> State:
        cfg = c.config
        nodes = c.place(cfg.max_workers)
        # Resources a previous job just released can take the cluster a moment to report free.
        deadline = time.monotonic() + min(cfg.replace_timeout_s, 10.0)
        while len(nodes) < cfg.max_workers and time.monotonic() < deadline:
            time.sleep(0.5)
            nodes = c.place(cfg.max_workers)
        world = cfg.max_workers
        if len(nodes) < world and len(nodes) >= cfg.min_workers:
            world = len(nodes)  # elastic: start with what fits; the recruiter grows it later
            logger.warning(
                "raymesh.train: room for %d of max %d workers now: starting with %d",
                world,
                cfg.max_workers,
                world,
            )
        c.ranks = c.spawn_ranks(world, "trainer", nodes=nodes[:world])
        room = c.pick_nodes(cfg.spares)  # spares where there is room now; the recruiter the rest
        c.spares = c.spawn_spares(len(room), nodes=room)
        infos = c.join([(r, "setup") for r in c.ranks])
        est: MemoryEstimate = infos[0]["estimate"]
        budget = min(i["budget_bytes"] for i in infos)
        shard = cfg.shard_size or host_shard_size([r.node_id for r in c.ranks])
        if shard and not splits_into_shard_groups(world, shard) and cfg.strategy == "auto":
            shard = None  # an elastic start below max: no whole shard groups to consider
        comm = {k: p.cost for k, p in c.plans.items()} if world == cfg.max_workers else None
        c.decision = c.strategy_policy.decide(
            cfg.strategy, est, world, budget, shard_size=shard, comm=comm if shard else None
        )
        c.base_decision = c.decision
        if c.decision.strategy in c.plans:
            c.placement = c.plans[c.decision.strategy].reason
        logger.info("raymesh.train: %s", c.decision.reason)
        resume = c.find_resume()
        start = c.gather([r.worker.prepare.call_one(c.decision, resume) for r in c.ranks])
        c.step = c.resumed_from = start[0]
        c.recruit()
        c.transition(
            "Running", f"{world} ranks, {infos[0]['params']:,} parameters, {c.decision.reason}"
        )
        return Running()


class Running(State):
    """Train chunk after chunk until `steps`, two chunks in flight."""

    name = "Running"

    def next(self, c: TrainController) -> State:
        cfg = c.config
        bounds = [*range(c.step, cfg.steps, cfg.report_every), cfg.steps]
        spans = list(itertools.pairwise(bounds))
        in_flight: list[tuple[tuple[int, int], list[Any]]] = []
        while spans or in_flight:
            grow = c.can_grow()
            if grow and not in_flight:  # drained at a step boundary: add the recruited ranks
                c.transition("Resizing", grow.reason)
                return Resizing(grow)
            while spans and len(in_flight) < 2 and not grow:
                start, stop = spans.pop(0)
                faults = [
                    f for f in c.pending_faults if f.when == "step" and start < f.at_step <= stop
                ]
                futs = [r.worker.run.call_one(start, stop, faults, c.sizes) for r in c.ranks]
                in_flight.append(((start, stop), futs))
            (start, stop), futs = in_flight.pop(0)
            results = c.settle(futs, c.chunk_timeout(stop - start))
            if all(isinstance(r, dict) and r["error"] is None for r in results):
                c.record([r["metrics"] for r in results])
                c.rebalance([r["metrics"] for r in results])
                continue
            # A failure: keep the steps every reporting rank completed (a lost rank's reply
            # can be lost with it), let the chunk queued behind it fail too, then heal.
            reported = [r["metrics"] for r in results if isinstance(r, dict)]
            if reported:
                common = min(len(m) for m in reported)
                c.record([m[:common] for m in reported])
            for _, later in in_flight:
                c.settle(later, c.chunk_timeout(0))
            c.failed_chunk = (start, stop, results)
            c.transition("Healing", c.describe(results))
            return Healing()
        c.transition("Finishing", f"reached step {c.step}")
        return Finishing()


class Healing(State):
    """Find the lost ranks, decide, replace them (or shrink), re-form, restore state."""

    name = "Healing"

    def next(self, c: TrainController) -> State:
        detected = time.time()
        t0 = time.monotonic()
        start, _, results = c.failed_chunk
        lost, started = c.find_lost(results, start)
        t_found = time.monotonic()
        now_failures = [
            FailureRecord(rank=i, step=started, cause=cause, kind=kind) for i, kind, cause in lost
        ]
        c.failures.extend(now_failures)
        # A rank is never more than one step ahead of the others (each step ends in an
        # all-reduce), so a lost rank's pending fault at or before the step in flight fired.
        for f in c.pending_faults[:]:
            fired = f.when == "step" and f.at_step <= started
            if fired and any(f.rank == i for i, _, _ in lost):
                c.pending_faults.remove(f)
        lost_ranks = sorted({i for i, _, _ in lost})
        world = len(c.ranks)
        # The failure budget first: no point waiting for capacity for a job that stops anyway.
        budget = c.decide(world, lost=len(lost_ranks), replacements=len(lost_ranks))
        if budget.action == "abort":
            logger.warning("raymesh.train: %s -> abort (%s)", c.describe(results), budget.reason)
            raise TooManyFailures(c.failures, c.latest_checkpoint())
        survivors = [i for i in range(world) if i not in lost_ranks]
        done = {i: results[i]["done"] for i in survivors if isinstance(results[i], dict)}
        # The survivor with the most completed steps holds the newest state. A survivor that
        # did not report was stuck in a collective with the lost rank, which fails (and frees
        # it) now that the rank is killed.
        if done:
            source: Rank | None = c.ranks[max(done, key=lambda i: done[i])]
        else:
            source = c.ranks[survivors[0]] if survivors else None
        t_stopped = time.monotonic()
        ranks, fresh, decision = c.replace_lost(c.ranks, lost_ranks, c.describe(results))
        t_replaced = time.monotonic()
        c.reform(ranks, fresh=fresh, source=source)
        logger.info(
            "raymesh.train: healing took %.2fs: find the lost ranks %.2fs, stop and replace "
            "them %.2fs, re-form and restore %.2fs",
            time.monotonic() - t0,
            t_found - t0,
            t_replaced - t_stopped,
            time.monotonic() - t_replaced,
        )
        for record in now_failures:
            c.healing.append((record, detected, started - c.step))
        c.recruit()
        c.transition(
            "Running",
            f"healed ({decision.action}): generation {c.generation}, {len(c.ranks)} ranks, "
            f"resuming at step {c.step}",
        )
        return Running()


class Resizing(State):
    """Grow the world with recruited ranks, at a step boundary (elastic jobs)."""

    name = "Resizing"

    def __init__(self, decision: FailureDecision) -> None:
        self.decision = decision

    def next(self, c: TrainController) -> State:
        new = c.take_spares(self.decision.world_size - len(c.ranks))
        if new:
            if c.decision is not None and c.decision.sharded:
                c.gather([r.worker.save.call_one(c.step) for r in c.ranks])
            c.reform(c.ranks + new, fresh=set(new), source=c.ranks[0])
        c.recruit()
        c.transition(
            "Running", f"grew by {len(new)}: generation {c.generation}, {len(c.ranks)} ranks"
        )
        return Running()


class Finishing(State):
    """Final checkpoint, the full weights from rank 0."""

    name = "Finishing"

    def next(self, c: TrainController) -> State:
        cfg = c.config
        every = cfg.checkpoint.every if cfg.checkpoint else 0
        save = cfg.checkpoint is not None and (every == 0 or c.step % every != 0)
        weights = c.gather([r.worker.finish.call_one(c.step, save) for r in c.ranks])[0]
        c.weights = weights or {}
        c.gather([r.worker.close.call_one() for r in c.ranks])
        c.transition("Finished", f"trained to step {c.step}")
        return Finished()


class Finished(State):
    name = "Finished"


class Failed(State):
    name = "Failed"


class TrainController:
    """Runs one training job (see the module docstring)."""

    def __init__(
        self,
        build: Callable | str,
        config: TrainConfig,
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.build = build
        self.config = config
        self.progress = progress
        self.strategy_policy = StrategyPolicy()
        self.balance_policy = BalancePolicy()
        self.grow_policy = GrowPolicy()
        self.sizes: list[int] | None = None  # samples per rank for the next chunks (None: even)
        self.placement: str | None = None  # the topology plan's reason, when one was made
        self.plans: dict[str, Placement] = {}  # by strategy, on the places the ranks hold
        self.rebalances: list[dict[str, Any]] = []
        self.failure_policy = FailurePolicy(
            max_failures=config.max_failures, window_s=config.failure_window_s
        )
        self.proc_meshes: list[Any] = []
        self.ranks: list[Rank] = []
        self.spares: list[Rank] = []
        self.use_gpus = _use_gpus(config)
        self.names = itertools.count()
        self.lock = threading.Lock()  # spares and proc_meshes, shared with the recruiter
        self.recruiter: threading.Thread | None = None
        self.claimed = 0  # spares taken for a reshape that has not finished
        self.stopping = threading.Event()
        self.decision: StrategyDecision | None = None
        self.base_decision: StrategyDecision | None = None  # from the start; resized per world
        self.step = 0
        self.resumed_from = 0
        self.generation = 0
        self.history: list[dict[str, float]] = []
        self.transitions: list[tuple[str, str]] = []
        self.failures: list[FailureRecord] = []
        self.pending_faults: list[Fault] = list(config.faults)
        self.failed_chunk: Any = None
        # (failure, wall time it was detected, steps recomputed): completed by the next record()
        self.healing: list[tuple[FailureRecord, float, int]] = []
        self.step_times: list[float] = []
        self.weights: dict[str, torch.Tensor] = {}
        run_dir = config.run_dir or (config.checkpoint.dir if config.checkpoint else None)
        self.metrics_path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        self.tensorboard = _tensorboard(Path(run_dir)) if run_dir else None

    # ---- the state machine -------------------------------------------------------------------
    def transition(self, state: str, reason: str) -> None:
        self.transitions.append((state, reason))
        logger.info("raymesh.train: -> %s (%s)", state, reason)

    def run(self) -> Result:
        state: State = Starting()
        self.transition("Starting", f"workers={self.config.workers}, {self.config.steps} steps")
        try:
            while not isinstance(state, (Finished, Failed)):
                state = state.next(self)
        except TooManyFailures as e:
            self.transition("Failed", str(e))
            raise
        except (ActorError, SupervisionError, TimeoutError) as e:
            self.transition("Failed", str(e).splitlines()[0])
            raise TrainError(
                f"training failed at step {self.step}: {str(e).splitlines()[0]}",
                cause=e,
                history=self.history,
            ) from e
        finally:
            self.stopping.set()
            if self.recruiter is not None:
                self.recruiter.join(timeout=30.0)
            for procs in self.proc_meshes:
                try:
                    procs.stop()
                except Exception:
                    logger.exception("raymesh.train: stopping trainer procs failed")
        assert self.decision is not None
        return Result(
            history=self.history,
            decision=self.decision,
            checkpoint=self.latest_checkpoint(),
            resumed_from=self.resumed_from,
            transitions=self.transitions,
            failures=self.failures,
            rebalances=self.rebalances,
            placement=self.placement,
            _weights=self.weights,
        )

    # ---- ranks -------------------------------------------------------------------------------
    def proc_resources(self) -> dict[str, float]:
        cfg = self.config
        res = {"CPU": float(cfg.cpus_per_worker)}
        if self.use_gpus:
            res["GPU"] = 1.0
        return {k: v for k, v in res.items() if v > 0} or {"CPU": 0.001}

    def pick_nodes(self, n: int, free: dict[str, int] | None = None) -> list[str]:
        """Up to `n` nodes (one per new rank, repeated) with room now (or in `free`, procs that
        fit per node), this host first."""
        out: list[str] = []
        if free is None:
            free = backend.free_slots(self.proc_resources())
        for node, fits in free.items():
            out.extend([node] * min(fits, n - len(out)))
        return out

    def place(self, n: int) -> list[str]:
        """Nodes for the first `n` ranks, in rank order. With room on several hosts, the
        topology planner orders them so that each process group crosses the fewest and fastest
        links (raymesh.topology), each host's ranks next to each other (one ring hop across
        hosts; HSDP's shard groups can be one host each). Where HSDP may be chosen, the
        strategies are planned on the same places too (`self.plans`), so the decision can weigh
        their communication; on one host there is nothing to choose."""
        cfg = self.config
        self.plans = {}
        free = backend.free_slots(self.proc_resources())
        if len(free) < 2:  # one look at the room: a second could see more, without a plan
            return self.pick_nodes(n, free)
        from raymesh import topology
        from raymesh.topology.planner import used

        topo = topology.discover(probe_timeout=5.0)
        if not self.use_gpus:  # CPU procs: plan over the room there is now
            hosts = tuple(
                dataclasses.replace(h, cpus=float(free.get(h.node_id, 0))) for h in topo.hosts
            )
            topo = dataclasses.replace(topo, hosts=hosts)
        device = "gpu" if self.use_gpus else "cpu"
        base = "fsdp" if cfg.strategy == "fsdp" else "ddp"
        try:
            placement = topology.plan(
                topo, topology.JobShape(world_size=n, strategy=base, device=device)
            )
        except ValueError as e:  # less room than ranks: take what there is (elastic may start)
            logger.warning("raymesh.train: no placement plan (%s); packing instead", e)
            return self.pick_nodes(n, free)
        self.plans[base] = placement
        # One group of every rank costs the same in any order: keep each host's ranks together,
        # hosts in topology order (the naive order of the places the plan chose), which is
        # also where HSDP's shard groups are one host each.
        there = used(topo, placement)
        order = [h.node_id for h in there.hosts]
        nodes = sorted(placement.node_ids, key=order.index)
        shard = cfg.shard_size or host_shard_size(nodes)
        if cfg.strategy in ("auto", "hsdp") and shard and splits_into_shard_groups(n, shard):
            for strategy in ("ddp", "fsdp", "hsdp"):
                dims = {"replicate": n // shard, "shard": shard} if strategy == "hsdp" else {}
                shape = topology.JobShape(world_size=n, strategy=strategy, device=device, **dims)
                self.plans[strategy] = topology.plan(there, shape, method="naive")
        self.placement = placement.reason
        logger.info("raymesh.train: placement: %s", placement.reason)
        return nodes

    def spawn_ranks(
        self, n: int, name: str, *, nodes: list[str] | None = None, timeout: float | None = None
    ) -> list[Rank]:
        """`n` new ranks (not yet in the process group), each a proc of its own with a trainer
        and a monitor, on `nodes` (default: where there is room, this host first; ranks
        without a node wait for room on this host, up to the timeout). Spawned concurrently;
        if one cannot be placed, the others are stopped and PlacementError raised."""
        if n == 0:
            return []
        nodes = list(self.pick_nodes(n) if nodes is None else nodes)
        nodes += [backend.current_node_id()] * (n - len(nodes))
        timeout = self.config.timeout_s if timeout is None else timeout
        with ThreadPoolExecutor(n) as pool:
            futures = [
                pool.submit(self._spawn_rank, f"{name}-{next(self.names)}", node, timeout)
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

    def _spawn_rank(self, name: str, node_id: str, timeout: float) -> Rank:
        host = HostMesh([n for n in backend.nodes() if n.node_id == node_id])
        axis = "gpus" if self.use_gpus else "procs"
        procs = host.spawn_procs(
            per_host={axis: 1},
            name=name,
            cpus_per_proc=self.config.cpus_per_worker,
            timeout=timeout,
        )
        procs._state.handled_by_owner = True  # this controller heals its procs' deaths itself
        with self.lock:
            self.proc_meshes.append(procs)
        if self.stopping.is_set():  # the job ended while this proc started
            procs.stop(timeout=10.0)
            raise backend.PlacementError(f"{name}: the job ended while it started")
        try:
            worker = procs.spawn("trainer", TrainWorker, self.build, self.config)
            monitor = procs.spawn("monitor", Monitor)
        except BaseException:
            procs.stop(timeout=10.0)
            raise
        return Rank(worker, monitor, procs, procs.pids[0], procs.node_ids[0])

    def spawn_spares(
        self, n: int, *, nodes: list[str] | None = None, timeout: float | None = None
    ) -> list[Rank]:
        """`n` warm spare ranks: spawned, built nothing yet, gloo already loaded."""
        spares = self.spawn_ranks(n, "spare", nodes=nodes, timeout=timeout)
        try:
            self.gather([r.worker.warm.call_one() for r in spares])
        except BaseException:
            for r in spares:
                r.stop()
            raise
        return spares

    def take_spares(self, n: int) -> list[Rank]:
        """Up to `n` live spares (dead ones are stopped and dropped). They count as claimed
        (not wanted again by the recruiter) until `reshape` makes them ranks."""
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
            nodes = self.pick_nodes(n - len(got))
            if nodes:
                try:
                    got += self.spawn_ranks(len(nodes), "trainer", nodes=nodes, timeout=remaining)
                except Exception as e:  # someone else took the room, or the proc failed
                    logger.info("raymesh.train: placing a replacement failed: %s", e)
                    time.sleep(min(0.5, max(deadline - time.monotonic(), 0.0)))
            else:
                time.sleep(min(0.2, remaining))
            got += self.take_spares(n - len(got))
        return got

    def decide(self, world: int, *, lost: int, replacements: int) -> FailureDecision:
        return self.failure_policy.decide(
            self.failures,
            world,
            replacements=replacements,
            lost=lost,
            min_workers=self.config.min_workers,
        )

    def replace_lost(
        self, ranks: list[Rank], lost: list[int], what: str
    ) -> tuple[list[Rank], set[Rank], FailureDecision]:
        """Stop the ranks at positions `lost` (killing a hung one), and fill their places
        with spares or new procs within `replace_timeout_s`; places left empty are dropped
        (shrink), within the failure policy. Returns the new world (replacements take the lost
        ranks' places: same rank order, so the same reduction order, hence bitwise-equal
        results at the same world size), the replacements, and the decision."""
        for i in lost:  # make sure a rank that raised or hung is gone, its room freed
            try:
                backend.kill_pid(ranks[i].node_id, ranks[i].pid)
            except Exception:  # its node may be gone with it
                pass
            ranks[i].stop()
        got = self.replacements(len(lost), self.config.replace_timeout_s)
        decision = self.decide(len(ranks), lost=len(lost), replacements=len(got))
        logger.warning("raymesh.train: %s -> %s (%s)", what, decision.action, decision.reason)
        if decision.action == "abort":
            for r in got:
                r.stop()
            raise TrainError(f"cannot heal: {decision.reason}", cause=None, history=self.history)
        places: list[Rank | None] = list(ranks)
        for i, r in zip(lost, got):
            places[i] = r
        for i in lost[len(got) :]:
            places[i] = None
        return [r for r in places if r is not None], set(got), decision

    def reform(self, ranks: list[Rank], *, fresh: set[Rank], source: Rank | None) -> None:
        """`reshape`, healing again when ranks are lost while the world re-forms (a
        replacement that dies as it joins, a survivor left stuck by it), until the world
        forms or the failure policy gives up. A DDP source's state, once fetched, is kept by
        the controller, so it survives the loss of its rank."""
        state = None
        while True:
            try:
                self.reshape(ranks, fresh=fresh, source=source, state=state)
                return
            except WorldBroken as broken:
                state = broken.state
                lost = sorted({i for i, _, _ in broken.lost})
                records = [
                    FailureRecord(rank=i, step=self.step + 1, cause=cause, kind=kind)
                    for i, kind, cause in broken.lost
                ]
                self.failures.extend(records)
                what = "while re-forming: " + "; ".join(str(r) for r in records)
                if self.decide(len(ranks), lost=len(lost), replacements=len(lost)).action == (
                    "abort"
                ):
                    raise TooManyFailures(self.failures, self.latest_checkpoint()) from None
                gone = {ranks[i] for i in lost}
                if source in gone:
                    source = None  # its state, if fetched, is `state`; else the checkpoint
                ranks, got, _ = self.replace_lost(ranks, lost, what)
                fresh = (fresh - gone) | got
                self.healing.extend((r, r.time, 0) for r in records)

    def reshape(
        self,
        ranks: list[Rank],
        *,
        fresh: set[Rank],
        source: Rank | None,
        state: dict[str, Any] | None = None,
    ) -> None:
        """Make `ranks` the world: the next process group generation, with every rank holding
        the same state. DDP with a `source` rank (or its `state`, fetched before): the new
        ranks build, the others re-form, and all load the source's state (a full replica, sent
        through the object store). FSDP and HSDP (or no source): every rank rebuilds in its
        warm process and loads the newest checkpoint, resharded for the new world (HSDP falls
        back to FSDP while the world does not split into its shard groups).

        Raises WorldBroken (naming the ranks, and carrying the DDP state it fetched) when a
        rank dies, or is stuck once another failed, while the world forms."""
        cfg = self.config
        assert self.decision is not None and self.base_decision is not None
        n = len(ranks)
        decision = self.base_decision.resized(n)
        if decision.strategy != self.decision.strategy:
            logger.warning("raymesh.train: %s", decision.reason)
        self.decision = decision
        # Faults that fire as ranks join this generation (tests of a failure while healing).
        join = [f for f in self.pending_faults if f.when == "join" and f.at_step == self.step + 1]
        for f in join:
            self.pending_faults.remove(f)

        def faults(i: int) -> list[Fault]:
            return [f for f in join if f.rank == i]

        local = local_ranks([r.node_id for r in ranks])

        if not self.decision.sharded and (source is not None or state is not None):
            if state is None:
                assert source is not None
                state = source.worker.get_state.call_one().get(timeout=cfg.timeout_s)
            addr, port = ranks[0].worker.address.call_one().get(timeout=cfg.timeout_s)
            calls = []
            for i, r in enumerate(ranks):
                if r in fresh:
                    calls.append(
                        [
                            r.worker.setup.call_one(
                                addr, port, i, n, local[i], measure=False, faults=faults(i)
                            ),
                            r.worker.prepare.call_one(self.decision, None),
                        ]
                    )
                else:
                    calls.append([r.worker.reform.call_one(addr, port, i, n, local[i], faults(i))])
            self.converge(calls, state)
            self.converge([[r.worker.set_state.call_one(state)] for r in ranks], state)
            self.step = state["done"]
        else:
            path = self.latest_checkpoint()
            if path is None:
                why = (
                    f"{self.decision.strategy.upper()} ranks hold only shards"
                    if source is not None
                    else "no rank survived"
                )
                raise TrainError(
                    f"cannot heal in place ({why}) and there is no checkpoint to heal from; set "
                    "checkpoint=CheckpointConfig(dir=..., every=N) so a lost rank can be restored",
                    cause=None,
                    history=self.history,
                )
            addr, port = ranks[0].worker.address.call_one().get(timeout=cfg.timeout_s)
            calls = [
                [
                    r.worker.setup.call_one(
                        addr, port, i, n, local[i], measure=False, faults=faults(i)
                    ),
                    r.worker.prepare.call_one(self.decision, path),
                ]
                for i, r in enumerate(ranks)
            ]
            self.step = self.converge(calls, None)[0]
            # Steps after the checkpoint are trained again: their first rows are void.
            self.history = [h for h in self.history if h["step"] <= self.step]
        with self.lock:
            self.ranks = ranks
            self.claimed = 0
        self.sizes = None  # a new world starts from the even split
        self.balance_policy.reset()
        self.generation += 1

    def converge(self, calls: list[list[Any]], state: dict[str, Any] | None) -> list[Any]:
        """Wait for each rank's calls (calls[i]: rank i's, in order) and return each rank's
        last result. A rank that died, or that is still blocked `HEAL_GRACE_S` after another
        failed (in a rendezvous that cannot complete), breaks the world: WorldBroken. An error
        on a live rank is collateral when another rank was lost (a peer gone mid-rendezvous),
        else it is raised as it is."""
        results = self.settle([f for fs in calls for f in fs], self.config.timeout_s)
        lost: list[tuple[int, str, str]] = []
        errors: list[BaseException] = []
        k = 0
        for i, fs in enumerate(calls):
            mine, k = results[k : k + len(fs)], k + len(fs)
            dead = [r for r in mine if isinstance(r, SupervisionError)]
            if dead:
                lost.append((i, "died", dead[0].failure.cause))
            elif any(isinstance(r, TimeoutError) for r in mine):
                lost.append((i, "stuck", "stuck joining the new world after a peer failed"))
            errors.extend(r for r in mine if isinstance(r, BaseException))
        if lost:
            raise WorldBroken(lost, state)
        if errors:
            raise errors[0]
        return [results[k - 1] for k in itertools.accumulate(len(fs) for fs in calls)]

    def can_grow(self) -> FailureDecision | None:
        """The grow decision, when recruited ranks are ready for an elastic job below max."""
        sharded = self.decision is not None and self.decision.sharded
        if sharded and self.config.checkpoint is None:  # shards move through a checkpoint
            return None
        with self.lock:
            ready = len(self.spares)
        return self.grow_policy.decide(
            len(self.ranks), max_workers=self.config.max_workers, ready=ready
        )

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
        # first). Spawning takes seconds, so it stays off the training path. It exits (under the
        # lock, so recruit() can start a new one) when nothing is wanted or the job ends.
        cfg = self.config
        while not self.stopping.is_set():
            with self.lock:
                wanted = self._wanted()
                if wanted <= 0:
                    self.recruiter = None
                    return
            try:
                nodes = self.pick_nodes(wanted)
                ranks = self.spawn_spares(len(nodes), nodes=nodes, timeout=10.0) if nodes else []
            except Exception as e:
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

    def join(self, members: list[tuple[Rank, str]]) -> list[Any]:
        """Form a process group of `members` (rank = position), calling `setup` on each."""
        addr, port = members[0][0].worker.address.call_one().get(timeout=self.config.timeout_s)
        n = len(members)
        local = local_ranks([r.node_id for r, _ in members])
        return self.gather(
            [
                getattr(r.worker, m).call_one(addr, port, i, n, local[i])
                for i, (r, m) in enumerate(members)
            ]
        )

    def gather(self, futures: list[Any]) -> list[Any]:
        return [f.get(timeout=self.config.timeout_s) for f in futures]

    def settle(self, futures: list[Any], timeout: float) -> list[Any]:
        """Each future's value, or the exception it raised, or TimeoutError for those not done
        by `timeout`. Once one rank has failed, the others get only `HEAL_GRACE_S` more: a
        survivor's collective fails as soon as its peer is gone, and one that does not is
        stuck, to be replaced rather than waited for."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [f for f in futures if not f.done()]
            if not pending:
                break
            if any(_failed(f) for f in futures if f not in pending):
                deadline = min(deadline, time.monotonic() + HEAL_GRACE_S)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:  # block on one of them, briefly, so failures elsewhere are noticed
                pending[0].get(timeout=min(0.1, remaining))
            except (ActorError, SupervisionError, TimeoutError):
                pass
        out: list[Any] = []
        for f in futures:
            try:
                out.append(f.get(timeout=0) if f.done() else TimeoutError("no reply"))
            except (ActorError, SupervisionError, TimeoutError) as e:
                out.append(e)
        return out

    def chunk_timeout(self, steps: int) -> float:
        """How long a chunk may take before its ranks count as hung: a multiple of the measured
        step time, never below the configured floor."""
        measured = sorted(self.step_times)[len(self.step_times) // 2] if self.step_times else 0.0
        return max(self.config.step_timeout_s, 10 * measured * max(steps, 1))

    def find_lost(self, results: list[Any], start: int) -> tuple[list[tuple[int, str, str]], int]:
        """The ranks to replace, as (rank, kind, cause), and the step that was in flight."""
        statuses = self.settle([r.monitor.status.call_one() for r in self.ranks], 10.0)
        done = [r["done"] for r in results if isinstance(r, dict)]
        # The step in flight: one past what the ranks that reported had completed; if none
        # reported (all stuck), the step the stuck ranks are in.
        started = (
            max(done) + 1
            if done
            else min([s["step"] for s in statuses if isinstance(s, dict)] or [start + 1])
        )
        lost: list[tuple[int, str, str]] = []
        for i, r in enumerate(results):
            if isinstance(r, SupervisionError):
                lost.append((i, "died", r.failure.cause))
            elif isinstance(r, ActorError):
                lost.append((i, "error", f"{r.remote_type}: {r.remote_message}"))
            elif isinstance(r, dict) and r["error"] is not None and r.get("cause") == "own":
                lost.append((i, "error", r["error"]))
        # A rank can report a peer's failure and then die itself (its node going down after
        # it): its monitor, which answers even for a hung trainer, tells.
        for i, st in enumerate(statuses):
            if isinstance(st, SupervisionError) and all(i != j for j, _, _ in lost):
                lost.append((i, "died", st.failure.cause))
        if lost:  # ranks that neither failed nor finished after a peer failed are stuck too
            for i, r in enumerate(results):
                if isinstance(r, TimeoutError):
                    lost.append((i, "stuck", "stuck in a collective after a peer failed"))
        else:
            # Nobody died or raised: the ranks that timed out are stuck. Those behind the
            # others (not yet in backward, where the waiting ranks sit) are the hung ones.
            waiting = [
                (s["step"], s["phase_index"]) if isinstance(s, dict) else (-1, -1) for s in statuses
            ]
            stuck = [w for i, w in enumerate(waiting) if isinstance(results[i], TimeoutError)]
            slowest = min(stuck, default=None)  # None: every rank failed on a peer, none lost
            for i, w in enumerate(waiting):
                if isinstance(results[i], TimeoutError) and w == slowest:
                    lost.append((i, "hung", f"no progress past step {w[0]} for the step timeout"))
        return lost, started

    def rebalance(self, per_rank: list[list[dict[str, float]]]) -> None:
        """Ask the balance policy for a new split from the chunk's measured speeds; a new split
        applies from the next chunk queued (every rank gets it with that chunk)."""
        sharded = self.decision is not None and self.decision.sharded
        if not self.config.rebalance or sharded or len(self.ranks) < 2:
            return
        steps = len(per_rank[0])
        samples = [sum(m["samples"] for m in ms) / steps for ms in per_rank]
        seconds = [sum(m["compute_s"] for m in ms) / steps for ms in per_rank]
        sizes = self.sizes or split_sizes(self.config.global_batch_size, len(self.ranks))
        decision = self.balance_policy.decide(samples, seconds, sizes)
        if decision is None:
            return
        self.sizes = list(decision.sizes)
        logger.info("raymesh.train: rebalance at step %d: %s", self.step, decision.reason)
        if decision.flagged:
            logger.warning(
                "raymesh.train: rank(s) %s flagged for replacement (far slower than the rest)",
                list(decision.flagged),
            )
        self.rebalances.append(
            {
                "step": self.step,
                "sizes": self.sizes,
                "flagged": list(decision.flagged),
                "reason": decision.reason,
            }
        )

    def describe(self, results: list[Any]) -> str:
        parts = []
        for i, r in enumerate(results):
            if isinstance(r, BaseException):
                parts.append(f"rank {i}: {type(r).__name__}: {str(r).splitlines()[0][:120]}")
            elif r["error"] is not None:
                parts.append(f"rank {i}: {r['error'][:120]}")
        return "; ".join(parts)

    # ---- checkpoints and metrics -------------------------------------------------------------
    def latest_checkpoint(self) -> str | None:
        if self.config.checkpoint is None:
            return None
        found = Checkpointer(self.config.checkpoint.dir).latest()
        return str(found) if found else None

    def find_resume(self) -> str | None:
        """The newest valid checkpoint of this job, if resuming is on and one exists."""
        cfg = self.config
        if cfg.checkpoint is None or cfg.resume is False:
            return None
        path = Checkpointer(cfg.checkpoint.dir).latest()
        if path is None:
            if cfg.resume is True:
                raise ValueError(
                    f"resume=True but {cfg.checkpoint.dir!r} holds no valid checkpoint; use "
                    "resume='auto' to start fresh when there is none"
                )
            return None
        manifest = Manifest.from_json((path / "manifest.json").read_text())
        for key in ("seed", "global_batch_size"):
            if manifest.config.get(key) != getattr(cfg, key):
                raise ValueError(
                    f"checkpoint {str(path)!r} is of another job ({key}="
                    f"{manifest.config.get(key)!r}, this job has {getattr(cfg, key)!r}); use "
                    "another checkpoint.dir, or resume=False to start fresh"
                )
        if manifest.data_position >= cfg.steps:
            logger.warning(
                "raymesh.train: %s is already at step %d (steps=%d): nothing to train; raise "
                "steps to train further",
                path,
                manifest.data_position,
                cfg.steps,
            )
        logger.info("raymesh.train: resuming from %s (step %d)", path, manifest.data_position)
        return str(path)

    def record(self, per_rank: list[list[dict[str, float]]]) -> None:
        """Fold one chunk's per-rank metrics into the history, the metrics file, progress."""
        cfg = self.config
        n = len(per_rank[0])
        if n == 0:
            return
        seconds = sum(m["step_s"] for m in per_rank[0])
        self.step_times.extend(m["step_s"] for m in per_rank[0])
        rate = cfg.global_batch_size * n / seconds if seconds > 0 else 0.0
        rows = []
        for i in range(n):
            loss = sum(r[i]["loss"] for r in per_rank) / len(per_rank)
            end = max(r[i]["end"] for r in per_rank)  # wall time the last rank finished it
            row = {"step": per_rank[0][i]["step"], "loss": loss, "samples_per_s": rate, "end": end}
            rows.append(row)
        self.history.extend(rows)
        self.step = int(rows[-1]["step"])
        if self.healing:  # the first step completed after healing: how long recovery took
            first_end = per_rank[0][0]["end"]
            for failure, detected, recomputed in self.healing:
                healed = dataclasses.replace(
                    failure, recovery_s=first_end - detected, steps_recomputed=recomputed
                )
                self.failures[self.failures.index(failure)] = healed
            self.healing.clear()
        if self.metrics_path is not None:
            self.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with self.metrics_path.open("a") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            for row in rows:
                self.tensorboard.add_scalar("loss", row["loss"], int(row["step"]))
                self.tensorboard.add_scalar("samples_per_s", rate, int(row["step"]))
            self.tensorboard.flush()
        if self.progress is not None:
            remaining = cfg.steps - self.step
            self.progress(
                {
                    "step": self.step,
                    "steps": cfg.steps,
                    "loss": rows[-1]["loss"],
                    "samples_per_s": rate,
                    "eta_s": remaining * seconds / n,
                    "ranks": [{"rank": r, "loss": m[-1]["loss"]} for r, m in enumerate(per_rank)],
                    "failures": len(self.failures),
                    "world_size": len(self.ranks),
                }
            )


def _failed(future: Any) -> bool:
    try:
        value = future.get(timeout=0)
    except (ActorError, SupervisionError, TimeoutError):
        return True
    return isinstance(value, dict) and value.get("error") is not None


def _tensorboard(run_dir: Path) -> Any:
    """A TensorBoard writer in the run folder when TensorBoard is installed, else None."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional; metrics.jsonl has everything
        return None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _use_gpus(cfg: TrainConfig) -> bool:
    if cfg.gpus is False:
        return False
    have = sum(n.gpus for n in backend.nodes())
    if cfg.gpus is True and have < cfg.min_workers:
        raise ValueError(f"gpus=True asks for {cfg.min_workers} GPUs; the cluster has {have:g}")
    return have >= cfg.min_workers
