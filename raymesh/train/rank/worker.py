"""The trainer actor: one per rank. It owns the process group, the model, the optimizer and the
data cursor; the controller tells it what to do, one endpoint call per phase, in the typed
messages of `raymesh.train.protocol`. (Over 400 lines: the actor's endpoints, one per phase of
a rank's life, read best as one class; joining the group, the batches, one step, evaluation and
the memory measurement live in `group`, `batches`, `step`, `evaluate` and `measure`.)

Determinism (what makes two runs with the same seed bit-identical, and a resumed run equal to an
uninterrupted one at the same world size):
- torch is seeded with `seed` before the build function runs, so every rank builds identical
  weights;
- the samples of step s are a pure function of (seed, s) (`raymesh.data.order`), split across
  ranks in rank order;
- before step s each rank reseeds torch with (seed, s, rank), so dropout and other random ops
  depend only on the step, not on how many steps this process has run;
- deterministic algorithms are requested, and intra-op threads are fixed per worker.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from raymesh._common import free_port
from raymesh.actor import Actor, Shared, context, endpoint, this_host
from raymesh.data import DataError
from raymesh.data.feed import Feed
from raymesh.data.sources import batch_reader
from raymesh.train.checkpoint import Checkpointer, Manifest
from raymesh.train.config import TrainConfig
from raymesh.train.hooks import RankHooks
from raymesh.train.materialize import materialize, place
from raymesh.train.packed import unpack
from raymesh.train.protocol import (
    ChunkResult,
    Feeders,
    Rendezvous,
    ReplicaState,
    SetupInfo,
    StepMetrics,
)
from raymesh.train.rank import group
from raymesh.train.rank.batches import Batches
from raymesh.train.rank.evaluate import due, evaluate
from raymesh.train.rank.full_state import Part, full_state, published
from raymesh.train.rank.measure import check_precision, estimate_memory
from raymesh.train.rank.monitor import mark
from raymesh.train.rank.parallelize import autocast_dtype, parallelize, settle_buckets
from raymesh.train.rank.step import Precision, Share, Timing, mix, run_step, seed_step
from raymesh.train.strategy import StrategyDecision
from raymesh.train.task import Context, Task, loss_only

logger = logging.getLogger("raymesh")

__all__ = ["TrainWorker"]


class TrainWorker(Actor):
    """One rank of a training job (see the module docstring for its guarantees)."""

    def __init__(self, build: Any, config: TrainConfig, driven: bool = False) -> None:
        self.build = build
        self.config = config
        # A driven job (train.drive): the loop supplies each step's samples (`supply`).
        self.driven = driven
        self.supplied: dict[int, Any] = {}  # step -> its samples: a list, or columns
        self.rank = -1
        self.world_size = 0
        self.next_step = 1  # the step the world this rank joined trains next (for hooks)
        self.task: Task | None = None
        self.model: torch.nn.Module | None = None  # the wrapped (DDP/FSDP) model
        self.checkpointer: Checkpointer | None = None
        self.decision: StrategyDecision | None = None
        self.hooks: RankHooks | None = None
        self.done = 0  # steps completed (the data position)
        self.sizes: list[int] | None = None  # samples per rank (None: the even split)
        self.timing = Timing(ddp_timings=config.rebalance)
        self.precision = Precision()  # set for the decided strategy by _wrap
        # With a pipeline (TrainConfig.data), batches come from its workers, made ahead; the
        # rank makes one itself only when no worker is left (see raymesh.data.feed).
        self.feed = Feed(config.data, config.seed) if config.data is not None else None
        mark(0, "idle")  # a proc kept warm (control.warm) last marked its previous job

    @endpoint
    def warm(self) -> None:
        """Get a spare ready to join fast (`group.warm_up`)."""
        group.warm_up()

    @endpoint
    def address(self) -> tuple[str, int]:
        """Where this rank can host the process group's store (rank 0 is asked)."""
        return this_host().addresses[0], free_port()

    @endpoint
    def install(self, hooks: RankHooks | None) -> None:
        """Hooks for the world this rank joins next (the controller sends them before the
        rendezvous; see `raymesh.train.hooks`)."""
        self.hooks = hooks

    def _join(self, rdv: Rendezvous) -> None:
        """Join (a new generation of) the process group, as `rdv` says."""
        if self.hooks is not None:
            self.hooks.on_join(rdv.rank, rdv.next_step)
        self.rank, self.world_size, self.next_step = rdv.rank, rdv.world_size, rdv.next_step
        group.join(rdv, device=self.device, timeout_s=self.config.timeout_s)

    @endpoint
    def setup(self, rdv: Rendezvous, measure: bool = True) -> SetupInfo:
        """Join the process group as `rdv` says, run the user's build function, and
        (`measure`) estimate memory for the strategy decision: at the start only, not when
        healing.

        On a rank that was set up before (an FSDP or HSDP job healing or resizing), it first
        leaves the old group and drops the old model: the process stays warm, the state is
        rebuilt."""
        cfg = self.config
        if self.task is not None:
            self._abort()
            self.task = None
            self.__dict__.pop("optimizer", None)
            gc.unfreeze()  # the old task was frozen with the rest (see _wrap)
            gc.collect()
        # A CPU proc can still see the machine's GPUs: use one only if Ray gave it one.
        use_cuda = cfg.gpus is not False and torch.cuda.is_available() and bool(context().gpu_ids)
        self.device = torch.device(f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu")
        check_precision(cfg.step.precision, self.device)
        self._join(rdv)
        if not use_cuda:
            torch.set_num_threads(max(1, int(cfg.cpus_per_worker)))
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.manual_seed(cfg.seed)
        ctx = Context(
            rank=rdv.rank,
            world_size=rdv.world_size,
            local_rank=rdv.local.rank,
            local_world_size=rdv.local.size,
            device=self.device,
            seed=cfg.seed,
            config=cfg,
        )
        task = self.build(ctx)
        if not isinstance(task, Task):
            raise TypeError(f"the build function returned {type(task).__name__}, not train.Task")
        if cfg.data is None and task.dataset is None and not self.driven:
            raise TypeError(
                "the build function's Task has no dataset: give Task(dataset=...), or a "
                "pipeline as TrainConfig(data=raymesh.data.Pipeline(source=...))"
            )
        place(task.model, self.device)  # a model built on meta is allocated when wrapped
        self.task = task
        self.batches = Batches(
            cfg.loop,
            n=(
                cfg.global_batch_size
                if self.driven
                else len(cfg.data)
                if cfg.data is not None
                else len(task.dataset)
            ),
            read=batch_reader(task.dataset, task.collate_fn) if task.dataset is not None else None,
            feed=self.feed,
            device=self.device,
            supplied=self.supplied if self.driven else None,
            collate=task.collate_fn,
        )
        params = sum(p.numel() for p in task.model.parameters())
        if not measure:
            return SetupInfo(params=params, device=str(self.device))
        batch, probe = None, cfg
        if cfg.activation_bytes is None:
            first = min(self.supplied, default=None) if self.driven else 0
            if first is None:  # a driven job started without an example step: not measured
                probe = dataclasses.replace(cfg, activation_bytes=0)
            else:
                self.batches.current = first
                batch = self.batches.load(self._micro(first)[0])
        memory, budget = estimate_memory(task, batch, probe, self.device, rdv.local.size)
        return SetupInfo(
            params=params, device=str(self.device), estimate=memory, budget_bytes=budget
        )

    @endpoint
    def prepare(self, decision: StrategyDecision, resume: str | None) -> int:
        """Wrap the model as decided, restore a checkpoint if given; return the next step."""
        assert self.task is not None
        self.decision = decision
        self.optimizer = self.task.optimizer
        self._wrap()
        self._new_checkpointer()
        start = 0
        if self.checkpointer is not None and resume is not None:
            assert self.model is not None
            # DCP restores only the optimizer keys a fresh optimizer has: "lr" comes back as the
            # saved step's scheduled rate, and "initial_lr" (the base rate run_step scales by the
            # schedule) not at all. The built optimizer's rates are the base ones: keep them.
            base = [g.get("initial_lr", g["lr"]) for g in self.optimizer.param_groups]
            manifest: Manifest = self.checkpointer.load(Path(resume), self.model, self.optimizer)
            for group, lr in zip(self.optimizer.param_groups, base):  # new groups: re-read
                group["initial_lr"] = lr
            start = manifest.data_position
        self.done = start
        return start

    def _wrap(self) -> None:
        """Wrap the user's model for the current process group, as the strategy decided."""
        assert self.task is not None and self.decision is not None
        # Everything alive now (Ray, torch, the user's task) outlives this wrapper: freeze it
        # out of the garbage collector, so the collection that drops the wrapper after a
        # failure (see _abort) scans little and takes milliseconds, not ~0.25 s. Collect first,
        # so no garbage of the build (or of a failed step) is frozen with it.
        gc.collect()
        gc.freeze()
        # Under FSDP2 its mixed-precision policy casts; elsewhere the step's autocast does.
        dtype = autocast_dtype(self.config.step.precision)
        scaler = self.precision.scaler  # kept across a heal: its scale is still good
        if self.config.step.precision == "fp16" and scaler is None:
            scaler = torch.amp.GradScaler(self.device.type)
        self.precision = Precision(None if self.decision.sharded else dtype, scaler)
        if self.world_size == 1 and not self.decision.sharded:
            # A world of one has nothing to reduce: DDP's hooks would cost ~0.7 ms a step (3x
            # the whole step of a small model) and change nothing. It is wrapped again as soon
            # as an elastic job grows (reform).
            materialize(self.task.model, self.device, self.task.init_weights, self.optimizer)
            self.model = self.task.model
            return
        self.model = parallelize(
            self.task.model,
            self.decision,
            world_size=self.world_size,
            device=self.device,
            optimizer=self.optimizer,
            precision=self.config.step.precision,
            ddp_timings=self.config.rebalance,  # per-step compute timings (see step.Timing)
            init_weights=self.task.init_weights,
        )

    def _new_checkpointer(self) -> None:
        ckpt = self.config.checkpoint
        if ckpt is not None:
            self.checkpointer = Checkpointer(ckpt.dir, keep=ckpt.keep, async_save=ckpt.async_save)

    def _abort(self) -> None:
        """Leave a broken process group at once, so peers blocked on us fail fast too."""
        if self.checkpointer is not None:
            try:
                self.checkpointer.wait()
            except Exception:
                pass  # its group is broken too; the last committed checkpoint stands
        # Drop the wrapper first: DDP's reducer holds the process group, and the group's
        # sockets only close (failing the peers' collectives) once nothing holds it. (FSDP2
        # keeps its groups alive past this, which is why HSDP's survivors that wait on this
        # rank in another group stay stuck: the controller replaces them, see detection.)
        if self.model is not None:
            self.model = None
            gc.collect()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                logger.warning(
                    "raymesh.train: rank %d: destroying its process group failed", self.rank
                )

    @endpoint
    def reform(self, rdv: Rendezvous) -> None:
        """Join the next generation of the process group as `rdv` says (a survivor of a
        failure), and wrap the model for it. DDP only: the caller then restores state with
        set_state."""
        assert self.task is not None
        self._abort()
        self._join(rdv)
        self._wrap()
        self._new_checkpointer()

    @endpoint
    def get_state(self) -> ReplicaState:
        """This rank's model and optimizer state and its completed steps (DDP: a full replica)."""
        assert self.task is not None
        return ReplicaState(
            model=self.task.model.state_dict(), optim=self.optimizer.state_dict(), done=self.done
        )

    @endpoint
    def set_state(self, state: ReplicaState, settle: bool = False) -> int:
        """Load a peer's state (tensors arrive as read-only shared memory: copy them first).
        `settle` (COLLECTIVE, every rank of the new world): first lay out the new DDP's
        buckets as the uninterrupted run's are after its first step (`settle_buckets`), so
        the healed run reduces in the same order and stays bitwise equal to it."""
        assert self.task is not None
        if settle and self.model is not None:
            task, model = self.task, self.model
            self.batches.current = state.done
            first = self._micro(state.done)[0]
            settle_buckets(model, lambda: loss_only(task.loss_fn)(model, self.batches.load(first)))
        self.task.model.load_state_dict(_clone(state.model))
        self.optimizer.load_state_dict(_clone(state.optim))
        self.done = state.done
        return self.done

    def _micro(self, step: int) -> list[list[int]]:
        return self.batches.micro(step, self.rank, self.world_size, self.sizes)

    @endpoint
    def supply(self, samples: dict[int, list[Any]], keep_from: int) -> None:
        """A driven job's samples: `samples[s]` holds the global batches of steps s, s + 1,
        ... in order (this rank trains its share of each); the steps before `keep_from` are
        forgotten."""
        self._supply(samples, keep_from)

    def _supply(self, samples: dict[int, list[Any]], keep_from: int) -> None:
        for step in [s for s in self.supplied if s < keep_from]:
            del self.supplied[step]
        for first, batches in samples.items():  # a bundle may start before keep_from
            self.supplied.update(
                (first + i, unpack(b)) for i, b in enumerate(batches) if first + i >= keep_from
            )

    def _step(self, step: int) -> tuple[float, dict[str, float]]:
        assert self.task is not None and self.model is not None
        cfg = self.config
        self.batches.start(step, self.rank, self.world_size, self.sizes)
        seed_step(mix(cfg.seed, step, self.rank), self.device)
        share = Share(
            step=step,
            rank=self.rank,
            world_size=self.world_size,
            global_batch_size=cfg.global_batch_size,
            micro=self._micro(step),
            load=self.batches.load,
        )
        return run_step(
            self.model,
            self.optimizer,
            self.task.loss_fn,
            share,
            config=cfg.step,
            steps=cfg.steps,
            device=self.device,
            precision=self.precision,
            timing=self.timing,
            hooks=self.hooks,
        )

    def _evaluate(self, step: int) -> float | None:
        """The eval loss after 0-based `step` when it is one to evaluate at (`due`); else
        None. COLLECTIVE."""
        assert self.task is not None and self.model is not None
        cfg, data = self.config, self.task.eval_dataset
        if data is None or not due(step + 1, cfg.steps, cfg.step.eval_every):
            return None
        batch = cfg.micro_batch_size or max(1, cfg.global_batch_size // self.world_size)
        return evaluate(
            self.model,
            loss_only(self.task.loss_fn),
            batch_reader(data, self.task.collate_fn),
            len(data),
            rank=self.rank,
            world_size=self.world_size,
            batch_size=batch,
            device=self.device,
            precision=self.precision,
        )

    @endpoint
    def run(
        self,
        start: int,
        stop: int,
        sizes: list[int] | None = None,
        feeders: Feeders | None = None,
        samples: dict[int, list[Any]] | None = None,
        keep_from: int = 0,
    ) -> ChunkResult:
        """Train steps [start, stop) (0-based) with `sizes` samples per rank (None: the even
        split), asking `feeders` for batches from now on (if given: the pipeline's workers
        changed); checkpoint on the configured steps. A driven job's `samples` and `keep_from`
        come with the call, as `supply` takes them.

        A failing step is not retried here: the rank leaves its process group at once (so
        peers blocked on it fail fast), reports why in the result, and the controller heals
        the job."""
        out: list[StepMetrics] = []
        ckpt = self.config.checkpoint
        if feeders is not None and self.feed is not None:  # first: the controller counts it heard
            self.feed.use(feeders.generation, feeders.workers)
        if samples:
            self._supply(samples, keep_from)
        if not dist.is_initialized():  # a chunk queued behind a failed one: nothing to do
            return ChunkResult((), self.done, error="no process group", cause="peer")
        self.sizes = sizes
        try:
            for step in range(start, stop):
                mark(step + 1, "start")
                if self.hooks is not None:
                    self.hooks.on_step(self.rank, step + 1)
                t0 = time.perf_counter()
                loss, stats = self._step(step)
                self.done = step + 1
                out.append(
                    StepMetrics(
                        step=step + 1,
                        loss=loss,
                        step_s=time.perf_counter() - t0,
                        end=time.time(),
                        compute_s=self.timing.compute_s,
                        samples=self.timing.samples,
                        data_wait_s=self.feed.take_wait() if self.feed is not None else None,
                        eval_loss=self._evaluate(step),
                        stats=stats or None,
                    )
                )
                if ckpt is not None and ckpt.every and (step + 1) % ckpt.every == 0:
                    self._save(step + 1)
                mark(step + 1, "done")
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[:500]}"
            cause: Literal["own", "peer", "data"] = (
                "data" if isinstance(e, DataError) else "peer" if group.is_comm_error(e) else "own"
            )
        else:
            return ChunkResult(tuple(out), self.done)
        # Out of the except block: its traceback, whose frames hold the wrapped model and so
        # the process group, is gone, and _abort can close the group's sockets.
        self._abort()
        return ChunkResult(tuple(out), self.done, error=error, cause=cause)

    @endpoint
    def save(self, done: int, extra: dict[str, Any] | None = None) -> None:
        """Checkpoint now, at `done` completed steps (collective), with `extra` (JSON data, the
        manifest's `extra`), and wait for the commit."""
        self._save(done, extra)
        assert self.checkpointer is not None
        self.checkpointer.wait()

    @endpoint
    def weights(self, trained_only: bool) -> Shared[dict[str, torch.Tensor]] | Part | None:
        """What this rank publishes of the full model state, on the CPU, stored once in its
        host's object store (`full_state.published`, COLLECTIVE: a sharded model's `Part`s,
        else the state from rank 0). `trained_only`: only the parameters that train (a LoRA
        model's adapters)."""
        assert self.task is not None and self.decision is not None
        names = None
        if trained_only:
            names = {n for n, p in self.task.model.named_parameters() if p.requires_grad}
        return published(self.task.model, sharded=self.decision.sharded, names=names)

    def _save(self, done: int, extra: dict[str, Any] | None = None) -> None:
        assert self.checkpointer is not None and self.decision is not None
        self.checkpointer.save(
            done,
            self.model,  # type: ignore[arg-type]
            self.optimizer,
            world_size=self.world_size,
            strategy=self.decision.strategy,
            config=self.config.to_dict(),
            data_position=done,
            rank=self.rank,
            extra=extra,
        )

    @endpoint
    def finish(
        self, done: int, save: bool, extra: dict[str, Any] | None = None
    ) -> dict[str, torch.Tensor] | None:
        """Final checkpoint (if asked, with `extra`), then the full model state on rank 0
        (collective)."""
        if save and self.checkpointer is not None:
            self._save(done, extra)
        if self.checkpointer is not None:
            self.checkpointer.wait()
        assert self.task is not None and self.decision is not None
        return full_state(self.task.model, sharded=self.decision.sharded)

    @endpoint
    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    @endpoint
    def release(self) -> None:
        """Leave the job, so the proc can serve another (raymesh.train.control.warm): wait for a
        checkpoint in flight, leave the process group, drop the model, optimizer and data."""
        self._abort()
        self.task = None
        self.checkpointer = None
        self.__dict__.pop("optimizer", None)
        self.feed = None  # its requests in flight are dropped with it
        # The job's objects were frozen with the rest (see _wrap): thaw, collect what is
        # garbage now, and freeze the rest again, so the next job's collection scans only
        # what it builds (a full collection here takes ~0.2 s).
        gc.unfreeze()
        gc.collect()
        gc.freeze()


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value
