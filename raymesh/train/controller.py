"""The training controller: an explicit state machine, driven from the user's process.

    Starting --> Running --> Finishing --> Finished
        \\           \\            \\
         +-----------+------------+--> Failed

Each state is a small class whose `next(controller)` does one phase and returns the next state;
the controller logs every transition with its reason. Decisions (the strategy; later, failure
handling and resizing) come from policy objects as data, and the states carry them out.

Reporting stays off the critical path: a `run` call trains `report_every` steps and returns
their metrics, and the controller keeps the next call queued behind the running one, so the
ranks never wait for the controller between chunks.
"""

from __future__ import annotations

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
from raymesh.train.checkpoint import Checkpointer, Manifest
from raymesh.train.config import TrainConfig
from raymesh.train.strategy import MemoryEstimate, StrategyDecision, StrategyPolicy
from raymesh.train.worker import TrainWorker

logger = logging.getLogger("raymesh")

__all__ = ["Result", "TrainController", "TrainError"]


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
    failures: list[dict[str, Any]] = field(default_factory=list)
    _weights: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The final model weights: CPU tensors under the model's own (unwrapped) names."""
        return dict(self._weights)


class State:
    name = "State"

    def next(self, c: TrainController) -> State:
        raise NotImplementedError


class Starting(State):
    """Spawn one proc and trainer per rank, form the process group, build, decide, restore."""

    name = "Starting"

    def next(self, c: TrainController) -> State:
        cfg = c.config
        gpus = _use_gpus(cfg)
        axis = "gpus" if gpus else "procs"
        c.procs = this_host().spawn_procs(
            per_host={axis: cfg.workers},
            name="trainers",
            cpus_per_proc=cfg.cpus_per_worker,
            timeout=cfg.timeout_s,
        )
        c.workers = c.procs.spawn("trainer", TrainWorker, c.build, cfg).flatten("rank")
        addr, port = c.workers.slice(rank=0).address.call_one().get(timeout=cfg.timeout_s)
        infos = c.workers.setup.call(addr, port).get(timeout=cfg.timeout_s).values()
        est: MemoryEstimate = infos[0]["estimate"]
        budget = min(i["budget_bytes"] for i in infos)
        c.decision = c.strategy_policy.decide(cfg.strategy, est, cfg.workers, budget)
        logger.info("raymesh.train: %s", c.decision.reason)
        resume = c.find_resume()
        start = c.workers.prepare.call(c.decision, resume).get(timeout=cfg.timeout_s).values()
        c.step = c.resumed_from = start[0]
        c.transition("Running", f"{infos[0]['params']:,} parameters, {c.decision.reason}")
        return Running()


class Running(State):
    """Train chunk after chunk until `steps`, two chunks in flight."""

    name = "Running"

    def next(self, c: TrainController) -> State:
        cfg = c.config
        chunk = cfg.report_every
        bounds = [*range(c.step, cfg.steps, chunk), cfg.steps]
        spans = list(itertools.pairwise(bounds))
        in_flight: list[Any] = []
        t_last = time.perf_counter()
        while spans or in_flight:
            while spans and len(in_flight) < 2:
                start, stop = spans.pop(0)
                in_flight.append(c.workers.run.call(start, stop))
            per_rank = in_flight.pop(0).get(timeout=cfg.timeout_s).values()
            now = time.perf_counter()
            c.record(per_rank, now - t_last)
            t_last = now
        c.transition("Finishing", f"reached step {c.step}")
        return Finishing()


class Finishing(State):
    """Final checkpoint, the full weights from rank 0, then stop the procs."""

    name = "Finishing"

    def next(self, c: TrainController) -> State:
        cfg = c.config
        every = cfg.checkpoint.every if cfg.checkpoint else 0
        save = cfg.checkpoint is not None and (every == 0 or c.step % every != 0)
        weights = c.workers.finish.call(c.step, save).get(timeout=cfg.timeout_s).values()[0]
        c.weights = weights or {}
        c.workers.close.call().get(timeout=cfg.timeout_s)
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
        self.procs: Any = None
        self.workers: Any = None
        self.decision: StrategyDecision | None = None
        self.step = 0
        self.resumed_from = 0
        self.history: list[dict[str, float]] = []
        self.transitions: list[tuple[str, str]] = []
        self.weights: dict[str, torch.Tensor] = {}
        run_dir = config.run_dir or (config.checkpoint.dir if config.checkpoint else None)
        self.metrics_path = Path(run_dir) / "metrics.jsonl" if run_dir else None
        self.tensorboard = _tensorboard(Path(run_dir)) if run_dir else None

    def transition(self, state: str, reason: str) -> None:
        self.transitions.append((state, reason))
        logger.info("raymesh.train: -> %s (%s)", state, reason)

    def run(self) -> Result:
        state: State = Starting()
        self.transition("Starting", f"{self.config.workers} workers, {self.config.steps} steps")
        try:
            while not isinstance(state, (Finished, Failed)):
                state = state.next(self)
        except (ActorError, SupervisionError, TimeoutError) as e:
            self.transition("Failed", str(e).splitlines()[0])
            raise TrainError(
                f"training failed at step {self.step}: {str(e).splitlines()[0]}",
                cause=e,
                history=self.history,
            ) from e
        finally:
            if self.procs is not None:
                try:
                    self.procs.stop()
                except Exception:
                    logger.exception("raymesh.train: stopping the trainer procs failed")
        assert self.decision is not None
        latest = None
        if self.config.checkpoint is not None:
            found = Checkpointer(self.config.checkpoint.dir).latest()
            latest = str(found) if found else None
        return Result(
            history=self.history,
            decision=self.decision,
            checkpoint=latest,
            resumed_from=self.resumed_from,
            transitions=self.transitions,
            _weights=self.weights,
        )

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

    def record(self, per_rank: list[list[dict[str, float]]], seconds: float) -> None:
        """Fold one chunk's per-rank metrics into the history, the metrics file, progress."""
        cfg = self.config
        n = len(per_rank[0])
        rate = cfg.global_batch_size * n / seconds if seconds > 0 else 0.0
        rows = []
        for i in range(n):
            loss = sum(r[i]["loss"] for r in per_rank) / len(per_rank)
            row = {"step": per_rank[0][i]["step"], "loss": loss, "samples_per_s": rate}
            rows.append(row)
        self.history.extend(rows)
        self.step = int(rows[-1]["step"])
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
                    "eta_s": remaining * seconds / n if n else 0.0,
                    "ranks": [{"rank": r, "loss": m[-1]["loss"]} for r, m in enumerate(per_rank)],
                }
            )


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
