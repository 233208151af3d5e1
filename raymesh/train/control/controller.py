"""The training controller: a run loop over explicit states, driven from the user's process.

    Starting --> Running --> Finishing --> Finished
                 |  ^  ^ \\ \
                 v  |  |  \\ Stopped        (a sink ended the job)
           Healing  Resizing Waiting       (any state --> Failed on an unrecoverable error)

`run()` calls `next_state()` until a terminal state; it runs one state's handler, which does
one phase and returns the next state with its reason (`raymesh.train.control.states`). Every
transition is logged and kept in `Result.transitions`. A driven job (`train.drive`) runs the
same states a step at a time: `open()` to Running, `drive(samples)` to Waiting (the step its
loop supplied is trained, healing on the way if a rank is lost), `close()` to Finished.
The controller composes rooms, each one concept: `Placer` (where ranks go), `RankPool`
(ranks, spares, the recruiter), `detection` (who was lost), `World` (form, heal, reshape),
`Balancer` (the split of the global batch), `Reporter` (what the sinks are told) and `RunLog`
(the result). Decisions come from the policies it is given (`Policies`: strategy, failure,
grow, balance) as data, and the handlers carry them out. The rooms that touch the cluster
(placer, rank pool) and the policies are constructor arguments (`TrainController.create`
makes the real ones; a unit test passes fakes).
(Over 400 lines: one handler per state, kept in one module so that every transition, and what
each handler asks of which room, reads in one place; the rooms do the work.)

Reporting stays off the critical path: a `run` call trains `report_every` steps and returns
their metrics, and the controller keeps the next call queued behind the running one, so the
ranks never wait for the controller between chunks.

Healing (DDP): when a rank dies (or raises, or hangs and is killed), the survivors abandon the
step in flight and leave their process group; the lost ranks are replaced by warm spares or new
procs; all ranks form the next generation of the process group; the survivor that completed
the most steps sends its model and optimizer state to every rank; training resumes at the first
step not completed. At most the step in flight is lost, and since the data order depends only
on the step, the final weights equal an uninterrupted run's at the same world size.
FSDP and HSDP ranks hold only shards, so such a job heals from its newest checkpoint instead:
every rank rebuilds (in its warm process) and loads it, resharded for the new world.

Elastic (`workers=(min, max)`): a lost rank that cannot be replaced within `replace_timeout_s`
is dropped and the job continues with fewer ranks (never below min), with the same global batch
split among them. The recruiter keeps looking for capacity (and refills the warm spares); when
it has ranks ready, Running drains its chunks at a step boundary and Resizing grows the world
back.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from raymesh.actor import ActorError, Shared, SupervisionError
from raymesh.data.workers import Workers
from raymesh.train.config import TrainConfig
from raymesh.train.control import detection, launch
from raymesh.train.control.balance import Balancer
from raymesh.train.control.failure import FailureDecision, TooManyFailures
from raymesh.train.control.member import Rank
from raymesh.train.control.placement import Placer
from raymesh.train.control.policies import Policies
from raymesh.train.control.ranks import RankPool
from raymesh.train.control.reporter import Reporter
from raymesh.train.control.resume import find_resume, latest_checkpoint
from raymesh.train.control.states import (
    TERMINAL,
    Failed,
    FailedChunk,
    Finished,
    Finishing,
    Healing,
    Resizing,
    Running,
    Starting,
    State,
    Stopped,
    Waiting,
)
from raymesh.train.control.warm import WarmRanks
from raymesh.train.control.world import World, replaced_by
from raymesh.train.hooks import TrainHooks
from raymesh.train.protocol import ChunkResult, Feeders, SetupInfo, StepMetrics
from raymesh.train.rank.full_state import Part, ShardedState
from raymesh.train.rank.measure import check_precision
from raymesh.train.reporting import sinks
from raymesh.train.result import Result, RunLog, TrainError

logger = logging.getLogger("raymesh")

__all__ = ["TrainController"]


class TrainController:
    """Runs one training job (see the module docstring)."""

    def __init__(
        self,
        config: TrainConfig,
        *,
        placer: Placer,
        pool: RankPool,
        policies: Policies,
        progress: Callable[[dict[str, Any]], None] | None = None,
        hooks: TrainHooks | None = None,
        data: Workers | None = None,
        driven: bool = False,
        labels: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.labels = labels or {}  # the "job" event's fields beside the config's
        # A driven job's steps its loop supplied and not yet forgotten: each step's bundle
        # (the samples of the steps of one `drive` call, stored once in this process's object
        # store), its place in it, and the loop's figures of it; None: `fit`.
        self.supplied: dict[int, tuple[Shared[list[Any]], int, dict[str, Any] | None]] | None = (
            {} if driven else None
        )
        self.hooks = hooks
        self.placer = placer
        self.pool = pool
        self.policies = policies
        # The pipeline's preprocessing procs (TrainConfig.data), beside the ranks, not in them.
        self.data = data
        self.log = RunLog(sinks(config.run_folder(), progress))
        self.reporter = Reporter(
            self.log,
            pool,
            global_batch_size=config.loop.global_batch_size,
            steps=config.loop.steps,
            data=data,
        )
        self.world = World(
            config.scaling,
            config.failure,
            config.checkpoint,
            pool,
            self.log,
            failure_policy=policies.failure,
            hooks=hooks,
        )
        self.balancer = Balancer(
            enabled=config.parallelism.rebalance,
            global_batch_size=config.loop.global_batch_size,
            policy=policies.balance,
        )
        self.resumed_from = 0
        self.resumed_path: str | None = None  # the checkpoint the job started from
        self.saved_at = 0  # the step of a driven job's newest save (`save`), committed
        self.warned_unbounded = False  # that a sharded driven job keeps every step's samples
        self.ended = False

    @classmethod
    def create(
        cls,
        build: Callable | str,
        config: TrainConfig,
        *,
        progress: Callable[[dict[str, Any]], None] | None = None,
        hooks: TrainHooks | None = None,
        warm: WarmRanks | None = None,
        driven: bool = False,
        labels: dict[str, Any] | None = None,
    ) -> TrainController:
        """A controller for `config` with the real rooms: ranks placed on the Ray cluster,
        taken from `warm` first. `driven`: a job its loop drives a step at a time; `labels`:
        what the run folder's "job" event says beside the config (a loop's kind of run)."""
        placer = Placer(config.scaling, config.parallelism)
        if not placer.gpus:  # the ranks' own check, before any proc starts
            check_precision(config.step.precision, torch.device("cpu"))
        loop = config.loop
        return cls(
            config,
            placer=placer,
            pool=RankPool(build, config, placer, warm, driven=driven),
            policies=Policies.of(config.failure),
            progress=progress,
            hooks=hooks,
            data=Workers(loop.data, loop.seed) if loop.data is not None else None,
            driven=driven,
            labels=labels,
        )

    # ---- the run loop ------------------------------------------------------------------------
    def run(self) -> Result:
        """Run the job to a terminal state; return its result, or raise what it failed with
        (`TooManyFailures`, `TrainError`; `ValueError` for a config the cluster refutes)."""
        return self.result(self.advance(self.starting(), until=()))

    def open(self, example: Shared[list[Any]] | None) -> None:
        """A driven job: start it (Starting, to Running), its ranks measuring memory on
        `example` (a bundle of one step's samples) when given. Raises as `run` does."""
        assert self.supplied is not None
        if example is not None:
            self.supplied[0] = (example, 0, None)
        state = self.advance(self.starting(), until=(Running,))
        if isinstance(state, TERMINAL):
            self.result(state)  # raises what it failed with
        if self.world.step > 0:  # resumed: the loop's next step is a later one
            self.supplied.clear()

    def drive(self, bundle: Shared[list[Any]], n: int, extra: dict[str, Any] | None) -> list[dict]:
        """A driven job: train the next `n` steps, one on each item of `bundle` (a step's
        global batch each, checked by the caller; stored once, sent in one call), healing on
        the way; their rows of the history (the last with `extra`, the loop's figures). Raises
        as `run` does, the job then ended."""
        assert self.supplied is not None
        first = self.world.step
        for i in range(n):
            self.supplied[first + i] = (bundle, i, extra if i == n - 1 else None)
        # Not entered: a step of a driven job is the loop's, not a transition of the job.
        state = self.advance(Running(f"step {first + 1}"), until=(Waiting,))
        if isinstance(state, TERMINAL):
            self.result(state)
        return self.log.history[-n:]

    def close(self, extra: dict[str, Any] | None) -> Result:
        """A driven job: finish it (the final checkpoint, with `extra`; the weights); its
        result."""
        finishing = Finishing("closed by its loop", extra)
        return self.result(self.advance(finishing, until=(), enter=True))

    def weights(self, trained_only: bool) -> Shared[dict[str, Any]] | ShardedState:
        """A driven job: the model's full state now, stored once (see `TrainWorker.weights`):
        rank 0's, or every rank's shards as one `ShardedState`."""
        ranks = self.world.ranks
        parts = self.world.gather([r.worker.weights.call_one(trained_only) for r in ranks])
        if isinstance(parts[0], Part):
            return ShardedState.of(parts)
        assert parts[0] is not None
        return parts[0]

    def save(self, extra: dict[str, Any] | None) -> str:
        """A driven job: checkpoint now, with `extra`; the committed step folder."""
        if self.config.checkpoint is None:
            raise ValueError(
                "save(): the job has no checkpoint section; give TrainConfig(checkpoint="
                "train.CheckpointConfig(dir=...))"
            )
        step = self.world.step
        self.world.gather([r.worker.save.call_one(step, extra) for r in self.world.ranks])
        self.saved_at = step
        return str(Path(self.config.checkpoint.dir) / f"step-{step:08d}")

    def starting(self) -> State:
        cfg = self.config
        self.reporter.job(cfg, self.labels)
        state = Starting(f"workers={cfg.scaling.workers}, {cfg.loop.steps} steps")
        self.enter(state)
        return state

    def advance(self, state: State, *, until: tuple[type, ...], enter: bool = False) -> State:
        """Run the states from `state` (entered first when `enter`) until one of `until` (a
        `Waiting` is never entered: it says nothing the step's row does not) or a terminal
        one, which ends the job: its procs stopped, or given back to the warm ranks."""
        if enter:
            self.enter(state)
        try:
            while not isinstance(state, TERMINAL):
                state = self.next_state(state)
                if not isinstance(state, Waiting):
                    self.enter(state)
                if isinstance(state, until):
                    return state
        except BaseException:
            self.end(state)
            raise
        self.end(state)
        return state

    def end(self, state: State | None) -> None:
        """Stop the job's procs (once), or give them back to the warm ranks when the ranks
        stopped at a step boundary: the job finished, or a sink ended it and the ranks
        finished their chunks. None: the caller's failure ended it."""
        if self.ended:
            return
        self.ended = True
        reuse = isinstance(state, Finished) or (isinstance(state, Stopped) and state.drained)
        self.pool.close(reuse=reuse)
        if self.data is not None:
            self.data.stop()

    def stop(self, error: BaseException | None) -> None:
        """A driven job: its loop ends it now, the run folder told so (Failed with `error`,
        the loop's failure; else Stopped), its procs stopped. Nothing once ended."""
        if self.ended:
            return
        if error is not None:
            first = (str(error).splitlines() or [""])[0]
            state: State = Failed(f"its loop failed: {type(error).__name__}: {first}"[:300], error)
        else:
            state = Stopped("stopped by its loop", RuntimeError("stopped by its loop"), False)
        try:
            self.enter(state)  # a sink that raises here must not leave the procs running
        finally:
            self.end(state)

    def result(self, state: State) -> Result:
        """The job's result, from its terminal `state`; or raise what it failed with."""
        if isinstance(state, (Failed, Stopped)):
            raise state.error
        assert self.world.decision is not None and isinstance(state, Finished)
        return Result(
            history=self.log.history,
            decision=self.world.decision,
            checkpoint=latest_checkpoint(self.config.checkpoint),
            resumed_from=self.resumed_from,
            transitions=self.log.transitions,
            failures=self.log.failures,
            rebalances=self.log.rebalances,
            placement=self.placer.reason,
            rank_step_s=self.log.rank_step_s,
            data=self.data.report() if self.data is not None else None,
            _weights=state.weights,
        )

    def next_state(self, state: State) -> State:
        """Run `state`'s phase; return the next state. A runtime failure that cannot be healed
        becomes `Failed`, carrying the error `run` raises."""
        try:
            if isinstance(state, Starting):
                return self.start()
            if isinstance(state, Running):
                return self.train()
            if isinstance(state, Healing):
                return self.heal(state.chunk)
            if isinstance(state, Resizing):
                return self.resize(state.grow)
            if isinstance(state, Finishing):
                return self.finish(state.extra)
            raise AssertionError(f"no handler for {state!r}")
        except (TooManyFailures, TrainError) as e:
            return Failed(str(e).splitlines()[0], e)
        except (ActorError, SupervisionError, TimeoutError) as e:
            first = str(e).splitlines()[0]
            error = TrainError(
                f"training failed at step {self.world.step}: {first}",
                cause=e,
                history=self.log.history,
            )
            error.__cause__ = e
            return Failed(first, error)

    def enter(self, state: State) -> None:
        name = type(state).__name__
        self.log.transition(name, state.reason, self.world.step)
        logger.info("raymesh.train: -> %s (%s)", name, state.reason)
        if isinstance(state, TERMINAL):
            self.log.emit("end", state=name, reason=state.reason, step=self.world.step)

    # ---- one handler per state ---------------------------------------------------------------
    def start(self) -> State:
        """Spawn one proc and trainer per rank (and the spares), form the process group, build,
        decide the strategy, restore a checkpoint."""
        cfg = self.config
        if self.data is not None:  # its procs start while the ranks do
            self.data.start()
        ranks = launch.first_ranks(cfg.scaling, self.pool, self.placer)
        self.pool.add_spares(cfg.scaling.spares)  # where there is room now; the recruiter the rest
        self.supply(ranks)  # a driven job's example step, which the ranks measure memory on
        infos: list[SetupInfo] = self.world.start(ranks)
        decision = launch.strategy_for(
            cfg.parallelism,
            cfg.step.precision,
            infos,
            ranks,
            max_workers=cfg.scaling.max_workers,
            placer=self.placer,
            policy=self.policies.strategy,
        )
        self.placer.choose(decision.strategy)
        self.resumed_path = find_resume(cfg)
        self.resumed_from = self.world.prepare(decision, self.resumed_path)
        running = self.world.decision  # `decision` resized to this world
        assert running is not None
        self.log.emit(
            "strategy",
            **dataclasses.asdict(running),
            params=infos[0].params,
            device=infos[0].device,
        )
        self.reporter.placement(self.world.ranks, self.placer)
        self.pool.recruit()
        return Running(f"{len(ranks)} ranks, {infos[0].params:,} parameters, {running.reason}")

    def train(self) -> State:
        """Train chunk after chunk until `steps`, two chunks in flight; a driven job, the steps
        its loop supplied, one a chunk, then wait for the next."""
        cfg = self.config
        if self.supplied is not None:
            # the steps supplied and not trained, as one chunk (they are consecutive)
            todo = [s for s in self.supplied if s >= self.world.step]
            spans = [(self.world.step, self.world.step + len(todo))] if todo else []
        else:
            loop = cfg.loop
            bounds = [*range(self.world.step, loop.steps, loop.report_every), loop.steps]
            spans = list(itertools.pairwise(bounds))
        in_flight: list[tuple[tuple[int, int], list[Any]]] = []
        while spans or in_flight:
            grow = self.can_grow()
            if grow and not in_flight:  # drained at a step boundary: add the recruited ranks
                return Resizing(grow.reason, grow)
            while spans and len(in_flight) < 2 and not grow:
                start, stop = spans.pop(0)
                samples, keep_from = self.supplies(range(start, stop))  # a driven job's
                futs = [
                    r.worker.run.call_one(
                        start, stop, self.balancer.sizes, self.feeders(r), samples, keep_from
                    )
                    for r in self.world.ranks
                ]
                in_flight.append(((start, stop), futs))
            (start, stop), futs = in_flight.pop(0)
            results = detection.settle(futs, self.chunk_timeout(stop - start))
            if not any(detection.failed(r) for r in results):
                per_rank = [r.metrics for r in results]
                try:
                    self.record(per_rank, extra=self.figures(stop - 1))
                except Exception as e:  # a sink ended the job (raymesh.tune prunes so)
                    return Stopped(f"a sink ended the job: {e!r}"[:200], e, self.drain(in_flight))
                self.rebalance(per_rank)
                self.scale_data(per_rank)
                continue
            for r in results:  # a sample that cannot be made fails the same way on any rank
                if isinstance(r, ChunkResult) and r.cause == "data":
                    raise TrainError(
                        f"training stopped at step {start + len(r.metrics) + 1}: {r.error}",
                        cause=None,
                        history=self.log.history,
                    )
            # A failure: keep the steps every reporting rank completed (a lost rank's reply
            # can be lost with it), let the chunk queued behind it fail too, then heal.
            reported = [r.metrics for r in results if isinstance(r, ChunkResult)]
            if reported:
                common = min(len(m) for m in reported)
                who = [isinstance(r, ChunkResult) for r in results]
                figures = self.figures(start + common - 1)  # a driven job's, of the last
                self.record([m[:common] for m in reported], reported=who, extra=figures)
            # A rank that timed out never reached the chunks behind this one: what they have
            # is all they will have (waiting a timeout more only doubled a hang's detection).
            # The others answer them within the grace of a failure, or are stuck in one.
            wait = self.chunk_timeout(0)
            later = [detection.settle_behind(fs, results, wait) for _, fs in in_flight]
            chunk = FailedChunk(start, stop, tuple(results), tuple(map(tuple, later)), tuple(futs))
            return Healing(detection.describe(results), chunk)
        if self.supplied is not None:
            return Waiting(f"trained step {self.world.step}")
        return Finishing(f"reached step {self.world.step}")

    def heal(self, chunk: FailedChunk) -> State:
        """Find the ranks `chunk` lost, decide, replace them (or shrink), re-form, restore."""
        detected = time.time()
        t0 = time.monotonic()
        ranks = self.world.ranks
        statuses = detection.settle([r.monitor.status.call_one() for r in ranks], 10.0)
        lost, started = detection.find_lost(chunk.results, statuses, chunk.start, chunk.later)
        t_found = time.monotonic()
        records = self.log.lost(lost, started)
        lost_ranks = sorted({x.rank for x in lost})
        if self.hooks is not None:
            self.hooks.on_lost(lost_ranks, started)
        # The failure budget first: no point waiting for capacity for a job that stops anyway.
        budget = self.world.decide(
            world=len(ranks), lost=len(lost_ranks), replacements=len(lost_ranks)
        )
        if budget.action == "abort":
            logger.warning("raymesh.train: abort: %s", budget.reason)
            raise TooManyFailures(self.log.failures, latest_checkpoint(self.config.checkpoint))
        # The survivor with the most completed steps holds the newest state. A survivor that
        # did not report was stuck in a collective with the lost rank, which fails (and frees
        # it) now that the rank is killed.
        survivors = [i for i in range(len(ranks)) if i not in lost_ranks]
        done = {i: r.done for i in survivors if isinstance(r := chunk.results[i], ChunkResult)}
        source: Rank | None = None
        if done:
            source = ranks[max(done, key=lambda i: done[i])]
        elif survivors:
            source = ranks[survivors[0]]
        t_stopped = time.monotonic()
        world, fresh, decision = self.world.replace_lost(ranks, lost_ranks)
        t_replaced = time.monotonic()
        self.reform(world, fresh=fresh, source=source)
        last = int(self.log.history[-1]["step"]) if self.log.history else self.resumed_from
        late = self.reporter.record_late(
            chunk, survivors, since=last, upto=self.world.step, figures=self.figures
        )
        self.reach(late)
        logger.info(
            "raymesh.train: healing took %.2fs: find the lost ranks %.2fs, stop and replace "
            "them %.2fs, re-form and restore %.2fs",
            time.monotonic() - t0,
            t_found - t0,
            t_replaced - t_stopped,
            time.monotonic() - t_replaced,
        )
        by = replaced_by(world, lost_ranks, decision)
        self.log.healed(
            records, detected, started - self.world.step, action=decision.action, replaced_by=by
        )
        self.pool.recruit()
        how = "".join(f", rank {r} by {proc}" for r, proc in by.items())
        return Running(
            f"healed ({decision.action}{how}): generation {self.world.generation}, "
            f"{len(self.world.ranks)} ranks, resuming at step {self.world.step}"
        )

    def resize(self, grow: FailureDecision) -> State:
        """Grow the world to `grow.world_size` with recruited ranks, at a step boundary."""
        ranks = self.world.ranks
        new = self.pool.take_spares(grow.world_size - len(ranks))
        if new:
            assert self.world.decision is not None
            if self.world.decision.sharded:  # shards move to the new world through a checkpoint
                self.world.gather([r.worker.save.call_one(self.world.step) for r in ranks])
            self.reform(ranks + new, fresh=set(new), source=ranks[0])
        self.pool.recruit()
        return Running(
            f"grew by {len(new)}: generation {self.world.generation}, {len(self.world.ranks)} ranks"
        )

    def finish(self, extra: dict[str, Any] | None) -> State:
        """Final checkpoint (with `extra`), the full weights from rank 0."""
        cfg, step, ranks = self.config, self.world.step, self.world.ranks
        every = cfg.checkpoint.every if cfg.checkpoint else 0
        save = cfg.checkpoint is not None and (every == 0 or step % every != 0)
        weights = self.world.gather([r.worker.finish.call_one(step, save, extra) for r in ranks])[0]
        self.world.gather([r.worker.close.call_one() for r in ranks])
        return Finished(f"trained to step {step}", weights or {})

    # ---- helpers of the handlers -------------------------------------------------------------
    def reform(self, ranks: list[Rank], *, fresh: set[Rank], source: Rank | None) -> None:
        self.supply(ranks)  # the steps to train again, for ranks that have not got them
        self.world.reform(ranks, fresh=fresh, source=source)
        self.balancer.reset()  # a new world starts from the even split
        self.reporter.mesh()

    def drain(self, in_flight: list[tuple[tuple[int, int], list[Any]]]) -> bool:
        """A sink (the progress callback) ended the job: let the ranks finish the chunks
        queued behind this one, so that they stop at a step boundary, out of any collective;
        whether they did (their procs can then serve another job)."""
        results = [
            r for (a, b), fs in in_flight for r in detection.settle(fs, self.chunk_timeout(b - a))
        ]
        return not any(detection.failed(r) for r in results)

    def can_grow(self) -> FailureDecision | None:
        """The grow decision, when recruited ranks are ready for an elastic job below max."""
        decision = self.world.decision
        if decision is not None and decision.sharded and self.config.checkpoint is None:
            return None  # shards move through a checkpoint
        return self.policies.grow.decide(
            len(self.world.ranks),
            max_workers=self.config.scaling.max_workers,
            ready=self.pool.ready(),
        )

    def supply(self, ranks: list[Rank]) -> None:
        """A driven job: send `ranks` the samples of every step kept, queued before the calls
        that train them (a world that forms: its ranks measure memory on them, or heal)."""
        samples, keep_from = self.supplies()
        if samples:
            for r in ranks:
                r.worker.supply.call_one(samples, keep_from)

    def supplies(self, steps: range | None = None) -> tuple[dict[int, Shared[list[Any]]], int]:
        """A driven job's samples of `steps` (None: of every step kept), as the bundles that
        hold them by the step of each one's first item, and the step the ranks may forget
        those before; ({}, 0) for `fit`. The steps no heal can go back to are
        forgotten here too: those a DDP world completed (survivors hold that state), or,
        sharded, those before the newest checkpoint surely committed (a sharded world heals
        from there)."""
        if not self.supplied:
            return {}, 0
        keep_from = self.world.step
        decision = self.world.decision
        ckpt = self.config.checkpoint
        if decision is not None and decision.sharded and ckpt is not None:
            # The newest multiple of `every` may still be committing: one before it is safe.
            every = (self.world.step // ckpt.every - 1) * ckpt.every if ckpt.every else 0
            keep_from = max(self.world.first_step, self.saved_at, every)
            if not ckpt.every and not self.warned_unbounded:
                self.warned_unbounded = True
                logger.warning(
                    "raymesh.train: a sharded driven job heals from its newest checkpoint, so "
                    "with checkpoint.every=0 it keeps every step's samples from its last save "
                    "or resume on (step %d) for that; set checkpoint=CheckpointConfig(every=N, "
                    "...) to keep at most 2N steps' samples",
                    keep_from,
                )
        for s in [s for s in self.supplied if s < keep_from]:
            del self.supplied[s]
        wanted = steps if steps is not None else sorted(self.supplied)
        bundles = {}
        for s in wanted:
            if s in self.supplied:
                bundle, i, _ = self.supplied[s]
                bundles[s - i] = bundle
        return bundles, keep_from

    def figures(self, step: int) -> dict[str, Any] | None:
        """What a driven job's loop reported of `step` (None: nothing, or `fit`)."""
        return self.supplied[step][2] if self.supplied and step in self.supplied else None

    def feeders(self, rank: Rank) -> Feeders | None:
        """The pipeline's workers, for a rank that has not heard of their latest set."""
        if self.data is None or rank.fed == self.data.generation:
            return None
        rank.fed = self.data.generation
        return Feeders(rank.fed, tuple(self.data.handles()))

    def scale_data(self, per_rank: list[tuple[StepMetrics, ...]]) -> None:
        """Tell the pipeline how long the ranks waited for batches; it replaces dead workers
        and scales (raymesh.data.scaling), and the ranks hear of the change with their next
        chunk."""
        if self.data is None:
            return
        waited = sum(m.data_wait_s or 0.0 for ms in per_rank for m in ms)
        ran = sum(m.step_s for ms in per_rank for m in ms)
        self.data.observe(waited, ran)
        self.data.tick()

    def chunk_timeout(self, steps: int) -> float:
        """How long a chunk may take before its ranks count as hung: a multiple of the measured
        step time, never below the configured floor; before any step is measured, the floor
        for each of its steps (a model whose step takes 12 s on CPU is slow, not hung)."""
        median = self.log.median_step_s()
        if median == 0:
            return self.config.failure.step_timeout_s * max(steps, 1)
        floor = self.config.failure.step_timeout_s
        return max(floor, 10 * median * max(steps, 1))

    def record(
        self,
        per_rank: list[tuple[StepMetrics, ...]],
        reported: list[bool] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Report one chunk's metrics (see `Reporter.record`); the world is at the newest step
        a chunk completed."""
        self.reach(self.reporter.record(per_rank, reported, extra))

    def reach(self, step: int | None) -> None:
        if step is not None:  # late steps never move it back
            self.world.step = max(self.world.step, step)

    def rebalance(self, per_rank: list[tuple[StepMetrics, ...]]) -> None:
        """A new split of the global batch, from the chunk's measured speeds, applies from the
        next chunk queued (every rank gets it with that chunk)."""
        decision = self.world.decision
        sharded = decision is not None and decision.sharded
        record = self.balancer.observe(per_rank, sharded=sharded, step=self.world.step)
        if record is not None:
            self.log.rebalances.append(record)
            self.log.emit("rebalance", **record)
