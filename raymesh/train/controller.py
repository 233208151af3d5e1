"""The training controller: an explicit state machine, driven from the user's process.

    Starting --> Running --> Finishing --> Finished
                  |   ^
                  v   |
                 Healing --> Failed   (and any state --> Failed on an unrecoverable error)

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
FSDP ranks hold only shards, so an FSDP job heals from its newest checkpoint instead.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from raymesh._src import backend
from raymesh._src.errors import ActorError, SupervisionError
from raymesh._src.proc_mesh import this_host
from raymesh.testing.faults import Fault
from raymesh.train.checkpoint import Checkpointer, Manifest
from raymesh.train.config import TrainConfig
from raymesh.train.failure import FailurePolicy, FailureRecord, TooManyFailures
from raymesh.train.strategy import MemoryEstimate, StrategyDecision, StrategyPolicy
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


@dataclass
class Result:
    """What `fit` returns."""

    history: list[dict[str, float]]  # one entry per step: step (1-based), loss (mean of ranks)
    decision: StrategyDecision  # the strategy and its arithmetic
    checkpoint: str | None  # the newest committed checkpoint folder, if checkpoints were on
    resumed_from: int  # the step the run started from (0: fresh)
    transitions: list[tuple[str, str]]  # (state, reason), in order
    failures: list[FailureRecord] = field(default_factory=list)  # and how each was healed
    _weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final model weights: CPU tensors under the model's own (unwrapped) names."""
        return dict(self._weights)


@dataclass
class Rank:
    """One member of the world: its trainer, the monitor beside it, and its process."""

    worker: Any  # ActorMesh of one TrainWorker
    monitor: Any  # ActorMesh of one Monitor, on the same proc
    pid: int
    node_id: str


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
        c.ranks = c.spawn_ranks(cfg.workers, "trainers")
        c.spares = c.spawn_ranks(cfg.spares, "spares") if cfg.spares else []
        infos = c.join([(r, "setup") for r in c.ranks])
        est: MemoryEstimate = infos[0]["estimate"]
        budget = min(i["budget_bytes"] for i in infos)
        c.decision = c.strategy_policy.decide(cfg.strategy, est, cfg.workers, budget)
        logger.info("raymesh.train: %s", c.decision.reason)
        resume = c.find_resume()
        start = c.gather([r.worker.prepare.call_one(c.decision, resume) for r in c.ranks])
        c.step = c.resumed_from = start[0]
        c.transition("Running", f"{infos[0]['params']:,} parameters, {c.decision.reason}")
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
            while spans and len(in_flight) < 2:
                start, stop = spans.pop(0)
                faults = [f for f in c.pending_faults if start < f.at_step <= stop]
                futs = [r.worker.run.call_one(start, stop, faults) for r in c.ranks]
                in_flight.append(((start, stop), futs))
            (start, stop), futs = in_flight.pop(0)
            results = c.settle(futs, c.chunk_timeout(stop - start))
            if all(isinstance(r, dict) and r["error"] is None for r in results):
                c.record([r["metrics"] for r in results])
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
    """Find the lost ranks, decide, replace them, re-form the process group, restore state."""

    name = "Healing"

    def next(self, c: TrainController) -> State:
        cfg = c.config
        detected = time.time()
        start, _, results = c.failed_chunk
        lost, started = c.find_lost(results, start)
        now_failures = [
            FailureRecord(rank=i, step=started, cause=cause, kind=kind) for i, kind, cause in lost
        ]
        c.failures.extend(now_failures)
        # A rank is never more than one step ahead of the others (each step ends in an
        # all-reduce), so a lost rank's pending fault at or before the step in flight fired.
        for f in c.pending_faults[:]:
            if any(f.rank == i for i, _, _ in lost) and f.at_step <= started:
                c.pending_faults.remove(f)
        decision = c.failure_policy.decide(
            c.failures, len(c.ranks), replacements=len(lost), lost=len(lost), min_workers=1
        )
        logger.warning(
            "raymesh.train: %s -> %s (%s)", c.describe(results), decision.action, decision.reason
        )
        if decision.action == "abort":
            raise TooManyFailures(c.failures, c.latest_checkpoint())
        lost_ranks = {i for i, _, _ in lost}
        for i in lost_ranks:  # make sure a rank that raised or hung is gone for good
            backend.kill_pid(c.ranks[i].node_id, c.ranks[i].pid)
        survivors = [i for i in range(len(c.ranks)) if i not in lost_ranks]
        if not survivors or c.decision is None or c.decision.strategy != "ddp":
            why = "no survivor holds the state" if not survivors else "FSDP ranks hold shards"
            raise TrainError(
                f"cannot heal in place ({why}); rerun to resume from the newest checkpoint",
                cause=None,
                history=c.history,
            )
        done = {i: results[i]["done"] for i in survivors if isinstance(results[i], dict)}
        source = max(done, key=lambda i: done[i]) if done else survivors[0]
        state = c.ranks[source].worker.get_state.call_one().get(timeout=cfg.timeout_s)
        for i in sorted(lost_ranks):
            c.ranks[i] = c.spares.pop(0) if c.spares else c.spawn_ranks(1, f"trainer-r{i}")[0]
        addr, port = c.ranks[0].worker.address.call_one().get(timeout=cfg.timeout_s)
        calls = []
        for i, r in enumerate(c.ranks):
            args = (addr, port, i, len(c.ranks), i)
            if i in lost_ranks:
                calls.append(r.worker.setup.call_one(*args))
                calls.append(r.worker.prepare.call_one(c.decision, None))
            else:
                calls.append(r.worker.reform.call_one(*args))
        c.gather(calls)
        c.gather([r.worker.set_state.call_one(state) for r in c.ranks])
        c.step = state["done"]
        for record in now_failures:
            c.healing.append((record, detected, started - c.step))
        c.generation += 1
        c.transition("Running", f"healed: generation {c.generation}, resuming at step {c.step}")
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
        self.failure_policy = FailurePolicy(
            max_failures=config.max_failures, window_s=config.failure_window_s
        )
        self.proc_meshes: list[Any] = []
        self.ranks: list[Rank] = []
        self.spares: list[Rank] = []
        self.decision: StrategyDecision | None = None
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
        self.transition("Starting", f"{self.config.workers} workers, {self.config.steps} steps")
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
            _weights=self.weights,
        )

    # ---- ranks -------------------------------------------------------------------------------
    def spawn_ranks(self, n: int, name: str) -> list[Rank]:
        """`n` new procs, each with a trainer and a monitor (not yet in the process group)."""
        cfg = self.config
        axis = "gpus" if _use_gpus(cfg) else "procs"
        procs = this_host().spawn_procs(
            per_host={axis: n}, name=name, cpus_per_proc=cfg.cpus_per_worker, timeout=cfg.timeout_s
        )
        procs._state.handled_by_owner = True  # this controller heals its procs' deaths itself
        self.proc_meshes.append(procs)
        flat = procs.flatten("rank")
        workers = flat.spawn("trainer", TrainWorker, self.build, cfg)
        monitors = flat.spawn("monitor", Monitor)
        pids, nodes = procs.pids, procs.node_ids
        return [
            Rank(workers.slice(rank=i), monitors.slice(rank=i), pids[i], nodes[i]) for i in range(n)
        ]

    def join(self, members: list[tuple[Rank, str]]) -> list[Any]:
        """Form a process group of `members` (rank = position), calling `setup` on each."""
        addr, port = members[0][0].worker.address.call_one().get(timeout=self.config.timeout_s)
        n = len(members)
        return self.gather(
            [getattr(r.worker, m).call_one(addr, port, i, n, i) for i, (r, m) in enumerate(members)]
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
        if lost:  # ranks that neither failed nor finished after a peer failed are stuck too
            for i, r in enumerate(results):
                if isinstance(r, TimeoutError):
                    lost.append((i, "hung", "stuck in a collective after a peer failed"))
        else:
            # Nobody died or raised: the ranks that timed out are stuck. Those behind the
            # others (not yet in backward, where the waiting ranks sit) are the hung ones.
            waiting = [
                (s["step"], s["phase_index"]) if isinstance(s, dict) else (-1, -1) for s in statuses
            ]
            slowest = min(w for i, w in enumerate(waiting) if isinstance(results[i], TimeoutError))
            for i, w in enumerate(waiting):
                if isinstance(results[i], TimeoutError) and w == slowest:
                    lost.append((i, "hung", f"no progress past step {w[0]} for the step timeout"))
        return lost, started

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
            row = {"step": per_rank[0][i]["step"], "loss": loss, "samples_per_s": rate}
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
                    f.write(json.dumps({**row, "time": time.time()}) + "\n")
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
    if cfg.gpus is True and have < cfg.workers:
        raise ValueError(f"gpus=True asks for {cfg.workers} GPUs; the cluster has {have:g}")
    return have >= cfg.workers
