"""The training controller's run loop, driven state by state over a fake rank pool.

No Ray and no torch.distributed here: `FakePool` stands in for the rank pool (as Ray Train's
controller tests swap in a dummy worker group) and its ranks answer every endpoint at once, the
way real ranks would, including dying at a chosen step or as they join a world, and hanging
(a reply that never comes; waiting for it takes real time). What is tested is the controller's own
logic: which state follows which, what each carries, what is recorded.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from raymesh.actor import MeshFailure, SupervisionError
from raymesh.train import TooManyFailures, TrainConfig
from raymesh.train.checkpoint import Checkpointer, Manifest
from raymesh.train.control.controller import TrainController
from raymesh.train.control.policies import Policies
from raymesh.train.control.states import (
    TERMINAL,
    Failed,
    Finished,
    Finishing,
    Healing,
    Resizing,
    Running,
    Starting,
)
from raymesh.train.driven import DrivenJob
from raymesh.train.estimate import MemoryEstimate
from raymesh.train.protocol import ChunkResult, RankStatus, ReplicaState, SetupInfo, StepMetrics
from raymesh.train.rank.monitor import PHASES

pytestmark = pytest.mark.timeout(30)


class Done:
    """A future that already holds its value (or error)."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def done(self) -> bool:
        return True

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class Pending:
    """A reply that never comes (a hung rank, or one blocked in a collective with it): each
    wait for it lasts its whole timeout, as a real one would."""

    def done(self) -> bool:
        return False

    def get(self, timeout: float | None = None) -> Any:
        time.sleep(timeout or 0.0)
        raise TimeoutError("no reply")


class Endpoint:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def call_one(self, *args: Any, **kwargs: Any) -> Done:
        return self.fn(*args, **kwargs)


class FakeWorker:
    """A rank's trainer and monitor in one: trains instantly, loss = step, dies on cue."""

    def __init__(self, rank: FakeRank) -> None:
        self.r = rank

    def __getattr__(self, name: str) -> Endpoint:
        method = getattr(self.r, "ep_" + name)

        def call(*args: Any, **kwargs: Any) -> Done:
            if not self.r.alive:
                return Done(error=self.r.gone())
            try:
                out = method(*args, **kwargs)
            except SupervisionError as e:
                return Done(error=e)
            return out if isinstance(out, Pending) else Done(out)

        return Endpoint(call)


@dataclasses.dataclass(eq=False)
class FakeRank:
    pool: FakePool
    name: str
    die_at: int | None = None  # the step (1-based) at which its proc dies
    hang_at: int | None = None  # the step (1-based) at which its trainer hangs
    # it completes the step a peer dies in (its side of gloo's collective ended first)
    ahead: bool = False
    dies_joining: bool = False  # its proc dies as it joins a world (setup)
    node_id: str = "node-0"
    alive: bool = True
    grouped: bool = False  # in a process group (a peer's failure ends it, as in gloo)
    done: int = 0
    position: int = -1
    world_size: int = 0
    stalled: tuple[int, str] | None = None  # (step, phase) where it waits, hung or blocked

    def __post_init__(self) -> None:
        self.worker = self.monitor = FakeWorker(self)
        self.prepared: list[tuple[str, str | None, int]] = []  # (strategy, resume, world size)

    def gone(self) -> SupervisionError:
        return SupervisionError(MeshFailure(self.name, (0,), "proc_died", "killed by SIGKILL"))

    def stop(self, *, kill: bool = False) -> None:
        self.alive = False
        self.pool.stopped.append(self.name)

    def label(self) -> str:
        return self.name

    def describe(self, rank: int | None) -> dict[str, Any]:
        state = "alive" if self.alive else "dead"
        return {"rank": rank, "mesh": self.name, "node_id": self.node_id, "state": state}

    # endpoints
    def ep_warm(self) -> None: ...
    def ep_install(self, hooks: Any) -> None: ...
    def ep_close(self) -> None: ...
    def ep_address(self) -> tuple[str, int]:
        return ("127.0.0.1", 29500)

    def ep_setup(self, rdv: Any, measure: bool = True) -> SetupInfo:
        if self.dies_joining:
            self.alive = False
            self.pool.dead.append(self.name)
            raise self.gone()
        self.position, self.grouped, self.stalled = rdv.rank, True, None
        self.world_size = rdv.world_size
        est = MemoryEstimate(param_bytes=40, grad_bytes=40, optimizer_bytes=0, activation_bytes=8)
        return SetupInfo(params=10, device="cpu", estimate=est, budget_bytes=1 << 30)

    def ep_reform(self, rdv: Any) -> None:
        self.position, self.grouped, self.stalled = rdv.rank, True, None
        self.world_size = rdv.world_size

    def ep_prepare(self, decision: Any, resume: str | None) -> int:
        self.prepared.append((decision.strategy, resume, self.world_size))
        if resume is not None:  # a checkpoint: its data position, as a real rank loads it
            self.done = Manifest.from_json((Path(resume) / "manifest.json").read_text()).step
        return self.done

    def ep_save(self, done: int) -> None:
        if self.position == 0:
            save_checkpoint(self.pool.config, done)

    def ep_get_state(self) -> ReplicaState:
        return ReplicaState(model={}, optim={}, done=self.done)

    def ep_set_state(self, state: ReplicaState, settle: bool = False) -> int:
        self.done = state.done
        return self.done

    def ep_run(self, start: int, stop: int, sizes: Any, feeders: Any = None, *driven: Any) -> Any:
        if not self.grouped:  # a chunk queued behind a failed one
            return ChunkResult((), self.done, error="no process group", cause="peer")
        if self.position == 0:
            time.sleep(self.pool.pause)
        hung = [r for r in self.pool.ranks if r.hang_at is not None and r.hang_at <= stop]
        if hung:  # one trainer hangs at its step; the others wait for it in the step's collective
            at = hung[0].hang_at
            assert at is not None
            self.done = max(self.done, at - 1)
            self.stalled = (at, "start" if self is hung[0] else "backward")
            return Pending()
        dying = [r.die_at for r in self.pool.ranks if r.die_at and start < r.die_at <= stop]
        end = min(dying, default=stop + 1) - 1  # the ranks complete the steps before a death
        if self.ahead and end < stop and self.die_at != end + 1:
            end += 1
        step_s = self.pool.step_s
        metrics = tuple(
            StepMetrics(step=s, loss=float(s), step_s=step_s, end=0.0, compute_s=step_s, samples=1)
            for s in range(start + 1, end + 1)
        )
        every = self.pool.config.checkpoint.every if self.pool.config.checkpoint else 0
        for s in range(start + 1, end + 1):
            if every and s % every == 0 and self.position == 0:
                save_checkpoint(self.pool.config, s)
        self.done = max(self.done, end)
        if end == stop:
            return ChunkResult(metrics, self.done)
        if self.die_at == end + 1:
            self.alive = False
            self.pool.dead.append(self.name)
            raise self.gone()
        self.grouped = False
        return ChunkResult(metrics, self.done, error="gloo: connection closed", cause="peer")

    def ep_status(self) -> RankStatus:
        step, phase = self.stalled or (self.done, "done")
        return RankStatus(step=step, phase=phase, phase_index=PHASES.index(phase), for_s=0, pid=1)

    def ep_finish(
        self, done: int, save: bool, extra: dict | None = None
    ) -> dict[str, torch.Tensor] | None:
        return {"w": torch.tensor(float(done))} if self.position == 0 else None


class FakePlacer:
    room: int | None = None  # ranks the cluster has room for at the start (None: any)

    def __init__(self, config: TrainConfig) -> None:
        self.gpus, self.plans, self.reason, self.topology = False, {}, None, None

    def place(self, n: int) -> list[str]:
        return ["node-0"] * (n if self.room is None else min(n, self.room))

    def capacity(self) -> int:  # the room at the start is all the cluster has
        return 1 << 30 if self.room is None else self.room

    def comm_costs(self) -> dict[str, float]:
        return {}

    def choose(self, strategy: str) -> None:
        pass


class FakePool:
    """The rank pool: ranks spawn at once; `die` says which spawned rank dies at which step;
    `capacity` limits how many replacements there are."""

    die: dict[int, int] = {}  # spawn index -> the step its proc dies at
    hang: dict[int, int] = {}  # spawn index -> the step its trainer hangs at
    ahead: tuple[int, ...] = ()  # spawn indices that complete the step a peer dies in
    capacity: int | None = None
    spares_ready = 0
    step_s = 0.01  # each step's measured time, as the ranks report it
    pause = 0.0  # real seconds each chunk takes

    def __init__(self, build: Any, config: TrainConfig, placer: Any, warm: Any = None) -> None:
        self.config = config
        self.ranks: list[FakeRank] = []
        self.spawned: list[FakeRank] = []
        self.stopped: list[str] = []
        self.dead: list[str] = []
        self.spares: list[FakeRank] = []
        self.closed = False

    def _new(self, name: str) -> FakeRank:
        i = len(self.spawned)
        rank = FakeRank(
            self,
            f"{name}-{i}",
            die_at=self.die.get(i),
            hang_at=self.hang.get(i),
            ahead=i in self.ahead,
        )
        self.spawned.append(rank)
        return rank

    def set_world(self, ranks: list[FakeRank]) -> None:
        self.ranks = ranks

    def ready(self) -> int:
        return len(self.spares)

    def snapshot(self) -> dict[str, Any]:
        return {
            "ranks": [r.describe(i) | {"host": "host-0"} for i, r in enumerate(self.ranks)],
            "spares": [r.describe(None) | {"host": "host-0"} for r in self.spares],
        }

    def spawn(self, n: int, name: str, *, nodes: Any = None, timeout: Any = None) -> list[FakeRank]:
        return [self._new(name) for _ in range(n)]

    def add_spares(self, n: int) -> None:
        self.spares += [self._new("spare") for _ in range(n + self.spares_ready)]

    def take_spares(self, n: int) -> list[FakeRank]:
        out, self.spares = self.spares[:n], self.spares[n:]
        return out

    def replacements(self, n: int, timeout: float) -> list[FakeRank]:
        room = n if self.capacity is None else min(n, self.capacity)
        return self.take_spares(room) + [self._new("trainer") for _ in range(room)][:room]

    def recruit(self) -> None: ...

    def take_warm(self, n: int) -> list[FakeRank]:
        return []

    def close(self, *, reuse: bool = False) -> None:
        self.closed, self.reused = True, reuse


def save_checkpoint(config: TrainConfig, step: int) -> Path:
    """A real committed checkpoint of a tiny model at `step` in the job's checkpoint folder,
    written by this process (no process group), with the job's config in its manifest."""
    assert config.checkpoint is not None
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    Checkpointer(config.checkpoint.dir, keep=config.checkpoint.keep).save(
        step,
        model,
        optimizer,
        world_size=1,
        strategy="ddp",
        config=config.to_dict(),
        data_position=step,
        rank=0,
    )
    return Path(config.checkpoint.dir) / f"step-{step:08d}"


def controller(
    pool: type = FakePool, placer: type = FakePlacer, progress: Any = None, **overrides: Any
) -> TrainController:
    config = TrainConfig(**{"workers": 2, "steps": 8, "global_batch_size": 4, **overrides})
    fake = placer(config)
    return TrainController(
        config,
        placer=fake,
        pool=pool(lambda ctx: None, config, fake, None),
        policies=Policies.of(config.failure),
        progress=progress,
    )


def pool_with(**attrs: Any) -> type:
    return type("Pool", (FakePool,), attrs)


def drive(c: TrainController, limit: int = 20, start: Any = None) -> list[Any]:
    """Step the controller from Starting (or `start`) to a terminal state (or `limit` states);
    every state it passed."""
    states: list[Any] = [start or Starting("test")]
    while not isinstance(states[-1], TERMINAL) and len(states) < limit:
        states.append(c.next_state(states[-1]))
    return states


def test_a_clean_run_goes_from_starting_to_finished_and_returns_every_step():
    c = controller(report_every=3)
    result = c.run()
    assert [s for s, _ in result.transitions] == ["Starting", "Running", "Finishing", "Finished"]
    assert [h["step"] for h in result.history] == list(range(1, 9))
    assert [h["loss"] for h in result.history] == [float(s) for s in range(1, 9)]
    assert result.decision.strategy == "ddp" and "fits" in result.decision.reason
    assert result.state_dict()["w"].item() == 8.0
    assert c.pool.closed, "the pool (and its procs) must be closed at the end"


def test_a_progress_callback_that_raises_stops_the_job_at_a_step_boundary_and_is_raised():
    class Prune(Exception):
        pass

    def progress(report: dict[str, Any]) -> None:
        if report["step"] >= 4:
            raise Prune("enough")

    c = controller(report_every=2, progress=progress)
    with pytest.raises(Prune):
        c.run()
    assert [s for s, _ in c.log.transitions] == ["Starting", "Running", "Stopped"]
    # the chunk queued behind the reported one finished: the procs can serve another job
    assert c.pool.closed and c.pool.reused


def test_a_dead_rank_is_healed_and_training_resumes_at_the_step_in_flight():
    c = controller(pool=pool_with(die={1: 5}), report_every=2)
    states = drive(c)
    kinds = [type(s) for s in states]
    assert kinds == [Starting, Running, Healing, Running, Finishing, Finished], states
    healing = states[2]
    # The state carries the failed chunk: it began at step 4 (0-based) and rank 1 died in it.
    assert (healing.chunk.start, healing.chunk.stop) == (4, 6)
    assert isinstance(healing.chunk.results[1], SupervisionError)
    assert isinstance(healing.chunk.results[0], ChunkResult) and healing.chunk.results[0].done == 4
    [failure] = c.log.failures
    assert (failure.rank, failure.step, failure.kind) == (1, 5, "died")
    assert failure.recovery_s is not None and failure.steps_recomputed == 1
    # The replacement took rank 1's place; the survivor kept its place.
    assert [r.name for r in c.pool.ranks] == ["trainer-0", "trainer-2"]
    assert "trainer-1" in c.pool.stopped
    assert [h["step"] for h in c.log.history] == list(range(1, 9))
    assert states[3].reason == (
        "healed (replace, rank 1 by trainer-2): generation 1, 2 ranks, resuming at step 4"
    )
    # One line, the root cause first: the survivor only saw its peer go.
    assert healing.reason == "rank 1 died: killed by SIGKILL; rank 0 saw its peer go"


def test_a_step_only_a_survivor_completed_is_recorded_once_its_state_is_restored():
    # Rank 2 dies in step 5; rank 0's side of the step's collective ended first, rank 1's did
    # not. The world resumes from rank 0's state, after step 5: step 5 is in the history once,
    # with rank 0's figures (a real 4-rank run lost a step's row this way).
    c = controller(pool=pool_with(die={2: 5}, ahead=(0,)), workers=3, report_every=4)
    states = drive(c)
    assert [type(s) for s in states] == [Starting, Running, Healing, Running, Finishing, Finished]
    assert states[3].reason.endswith("resuming at step 5"), states[3].reason
    assert [h["step"] for h in c.log.history] == list(range(1, 9))
    [row] = [h for h in c.log.history if h["step"] == 5]
    assert row["loss"] is None and (row["partial_loss"], row["reported"]) == (5.0, [0])


def test_the_run_folder_tells_every_state_the_failure_and_how_it_was_healed(tmp_path):
    c = controller(pool=pool_with(die={1: 5}), report_every=2, run_dir=str(tmp_path))
    c.run()
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds[:2] == ["job", "state"] and kinds[-2:] == ["state", "end"], kinds
    states = [(e["state"], e["step"]) for e in events if e["event"] == "state"]
    assert states == [
        ("Starting", 0),
        ("Running", 0),
        ("Healing", 4),
        ("Running", 4),
        ("Finishing", 8),
        ("Finished", 8),
    ]
    [strategy] = [e for e in events if e["event"] == "strategy"]
    assert strategy["strategy"] == "ddp" and strategy["estimate"]["param_bytes"] == 40
    [failure] = [e for e in events if e["event"] == "failure"]
    assert (failure["rank"], failure["step"], failure["kind"]) == (1, 5, "died")
    assert "SIGKILL" in failure["cause"]
    [healed] = [e for e in events if e["event"] == "healed"]
    assert (healed["rank"], healed["action"], healed["replaced_by"]) == (1, "replace", "trainer-2")
    assert healed["steps_recomputed"] == 1 and healed["recovery_s"] is not None
    # The failure is told when it is found, the healing once training has moved on.
    assert kinds.index("failure") < kinds.index("healed")
    meshes = [e for e in events if e["event"] == "mesh"]
    assert [[p["mesh"] for p in m["ranks"]] for m in meshes] == [
        ["trainer-0", "trainer-1"],
        ["trainer-0", "trainer-2"],
    ]
    assert events[-1] == {**events[-1], "event": "end", "state": "Finished", "step": 8}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert all(r["rank_loss"] == [r["loss"]] * 2 and len(r["rank_step_s"]) == 2 for r in rows)
    assert all(r["world_size"] == 2 for r in rows)


def test_a_chunk_some_ranks_did_not_report_keeps_each_figure_at_its_rank():
    from raymesh.train.result import RunLog

    def metrics(loss: float) -> list[StepMetrics]:
        return [StepMetrics(step=1, loss=loss, step_s=loss / 10, end=0, compute_s=0, samples=1)]

    report = RunLog().record(
        [metrics(1.0), metrics(3.0)], global_batch_size=4, steps=8, reported=[True, False, True]
    )
    assert report is not None and report.world_size == 3
    assert report.rank_loss == ((1.0, None, 3.0),)
    assert report.rank_step_s == ((0.1, None, 0.3),)


def test_failures_past_the_budget_end_in_failed_carrying_too_many_failures():
    c = controller(pool=pool_with(die={1: 3}), max_failures=0)
    states = drive(c)
    assert isinstance(states[-1], Failed) and isinstance(states[-1].error, TooManyFailures)
    assert [type(s) for s in states] == [Starting, Running, Healing, Failed]
    with pytest.raises(TooManyFailures):
        controller(pool=pool_with(die={1: 3}), max_failures=0).run()


def test_an_elastic_job_without_replacements_shrinks_and_goes_on():
    c = controller(pool=pool_with(die={2: 3}, capacity=0), workers=(2, 3), global_batch_size=6)
    states = drive(c)
    assert [type(s) for s in states] == [Starting, Running, Healing, Running, Finishing, Finished]
    assert states[3].reason.startswith("healed (shrink)")
    assert len(c.pool.ranks) == 2 and [h["step"] for h in c.log.history] == list(range(1, 9))


def test_an_elastic_job_grows_when_ranks_are_ready_at_a_step_boundary():
    c = controller(pool=pool_with(die={2: 3}, capacity=0), workers=(2, 3), global_batch_size=6)
    states = drive(c, limit=4)  # Starting, Running, Healing, Running: shrunk to 2
    assert len(c.pool.ranks) == 2
    c.pool.spares.append(c.pool._new("spare"))  # the recruiter found a rank
    grown = c.next_state(states[-1])
    assert isinstance(grown, Resizing) and grown.grow.world_size == 3
    assert isinstance(c.next_state(grown), Running) and len(c.pool.ranks) == 3


def test_a_runtime_error_outside_healing_fails_the_job_with_a_train_error():
    class Broken(FakePool):
        def spawn(self, n: int, name: str, **kw: Any) -> list[FakeRank]:
            ranks = super().spawn(n, name, **kw)
            ranks[0].alive = False  # its proc is gone before setup
            return ranks

    from raymesh.train import TrainError

    states = drive(controller(pool=Broken))
    assert [type(s) for s in states] == [Starting, Failed]
    assert isinstance(states[-1].error, TrainError)
    assert isinstance(states[-1].error.cause, SupervisionError)


# ---- the hang timeout: 10x the measured step time, never below step_timeout_s ----------------


@pytest.mark.parametrize(
    ("floor", "times", "steps", "expected"),
    [
        (30.0, [], 4, 120.0),  # nothing measured yet: the floor for each step
        (30.0, [], 0, 30.0),
        (1.0, [0.2] * 5, 2, 4.0),  # 10 x 0.2 s x 2 steps, above the floor
        (1.0, [0.2] * 5, 0, 2.0),  # a chunk of no steps still allows one step
        (1.0, [0.01] * 5, 4, 1.0),  # 10 x 0.01 s x 4 steps is below the floor
        (1.0, [0.01, 0.01, 0.01, 5.0, 5.0], 2, 1.0),  # the median: outliers do not count
        (1.0, [0.01, 0.3, 0.3, 0.3, 9.0], 1, 3.0),
    ],
)
def test_the_hang_timeout_is_ten_times_the_median_step_per_step_never_below_the_floor(
    floor, times, steps, expected
):
    c = controller(step_timeout_s=floor)
    c.log.step_times = list(times)
    assert c.chunk_timeout(steps) == pytest.approx(expected)


def test_a_hung_rank_is_found_after_ten_times_the_measured_step_not_the_floor():
    # Steps measured at 0.025 s and a floor of 0.1 s: the second chunk, 4 steps, may take 1 s
    # (10 x 0.025 x 4), so the hang in it is found after about 1 s, not after the floor.
    pool = pool_with(hang={1: 5}, step_s=0.025)
    c = controller(pool=pool, report_every=4, step_timeout_s=0.1)
    states: list[Any] = [Starting("test")]
    seconds = []
    while not isinstance(states[-1], (Healing, Finished, Failed)):
        t0 = time.monotonic()
        states.append(c.next_state(states[-1]))
        seconds.append(time.monotonic() - t0)
    assert [type(s) for s in states] == [Starting, Running, Healing], states
    expected = 10 * 0.025 * 4
    assert expected <= seconds[-1] < 2 * expected + 1.0, seconds
    assert states[-1].reason == "rank 0 did not answer in time; rank 1 did not answer in time"
    assert isinstance(drive(c, start=states[-1])[-1], Finished)
    [failure] = c.log.failures
    assert (failure.rank, failure.step, failure.kind) == (1, 5, "hung")
    assert failure.cause == "no progress past step 5 for the step timeout"
    assert "trainer-1" in c.pool.stopped and [r.name for r in c.pool.ranks] == [
        "trainer-0",
        "trainer-2",
    ]
    assert [h["step"] for h in c.log.history] == list(range(1, 9))


# ---- failure_window_s ------------------------------------------------------------------------


@pytest.mark.parametrize(("window", "ends"), [(0.1, Finished), (30.0, Failed), (None, Failed)])
def test_failures_older_than_the_window_do_not_count_towards_max_failures(window, ends):
    # Rank 1 dies at step 3 and its replacement at step 6, three chunks of 0.05 s later: with
    # max_failures=1, the second failure ends the job unless the first one is out of the window.
    pool = pool_with(die={1: 3, 2: 6}, pause=0.05)
    c = controller(pool=pool, report_every=1, max_failures=1, failure_window_s=window)
    states = drive(c)
    assert isinstance(states[-1], ends), states[-1]
    first, second = c.log.failures
    assert (first.step, second.step) == (3, 6)
    assert second.time - first.time >= 0.15
    if ends is Failed:
        assert isinstance(states[-1].error, TooManyFailures)
    else:
        assert [h["step"] for h in c.log.history] == list(range(1, 9))
        healing = [s.reason for s in states if isinstance(s, Running)][-1]
        assert healing.startswith("healed (replace, rank 1 by trainer-3)"), healing


# ---- a failure while the world grows (Resizing) ----------------------------------------------


@pytest.mark.parametrize(
    ("capacity", "max_failures", "world"), [(1, 3, 3), (0, 3, 2), (1, 1, None)]
)
def test_a_rank_lost_as_the_world_grows_is_healed_within_the_failure_budget(
    capacity, max_failures, world
):
    # Shrunk to 2 (no room for rank 2's replacement), the job grows with a recruited rank that
    # dies as it joins. It is replaced (room for one), or dropped (no room: the world stays at
    # 2), or, past max_failures, the job stops with every failure.
    pool = pool_with(die={2: 3}, capacity=0)
    c = controller(pool=pool, workers=(2, 3), global_batch_size=6, max_failures=max_failures)
    states = drive(c, limit=4)
    assert [type(s) for s in states] == [Starting, Running, Healing, Running]
    joining = c.pool._new("spare")
    joining.dies_joining = True
    c.pool.spares.append(joining)
    c.pool.capacity = capacity
    grown = c.next_state(states[-1])
    assert isinstance(grown, Resizing), grown
    after = c.next_state(grown)
    lost = [(f.rank, f.kind) for f in c.log.failures]
    assert lost == [(2, "died"), (2, "died")], c.log.failures
    assert joining.name in c.pool.dead
    if world is None:  # (run() then closes the pool, which stops every proc)
        assert isinstance(after, Failed) and isinstance(after.error, TooManyFailures)
        assert len(after.error.failures) == 2
        return
    assert joining.name in c.pool.stopped
    assert isinstance(after, Running) and len(c.pool.ranks) == world, after
    assert c.log.failures[1].action == ("replace" if capacity else "shrink")
    assert isinstance(drive(c, start=after)[-1], Finished)
    assert [h["step"] for h in c.log.history] == list(range(1, 9))


# ---- resume="auto" and another job's checkpoint ----------------------------------------------


def test_resume_auto_takes_this_jobs_checkpoint_and_refuses_another_jobs(tmp_path):
    def job(folder: str, **kw: Any) -> dict[str, Any]:
        ckpt = {"dir": str(tmp_path / folder)}
        return {"workers": 2, "steps": 8, "global_batch_size": 4, "checkpoint": ckpt, **kw}

    # Another seed, or another global batch size: another sample order, another job.
    for key, value in (("seed", 1), ("global_batch_size", 8)):
        save_checkpoint(TrainConfig(**job(key, **{key: value})), 4)
        c = controller(**job(key))
        with pytest.raises(ValueError, match=r"is of another job .*resume=False") as info:
            c.run()
        assert f"({key}={value!r}, this job has" in str(info.value)
        assert all(r.prepared == [] for r in c.pool.spawned), "no rank may load it"
        assert c.pool.closed
        fresh = controller(**job(key, resume=False))  # starts fresh beside it
        assert fresh.run().resumed_from == 0
        assert [r.prepared[0][1] for r in fresh.pool.spawned] == [None, None]
    # The same job: other steps and workers are the same job, trained further or resized.
    path = save_checkpoint(TrainConfig(**job("same", steps=4, workers=(1, 2))), 4)
    c = controller(**job("same"))
    result = c.run()
    assert result.resumed_from == 4
    assert [r.prepared[0][1] for r in c.pool.spawned] == [str(path), str(path)]
    assert [h["step"] for h in result.history] == list(range(5, 9))


# ---- HSDP shrinking to FSDP and growing back -------------------------------------------------


def test_hsdp_shrinks_to_fsdp_and_grows_back_to_hsdp_each_from_the_newest_checkpoint(
    tmp_path, caplog
):
    # 4 ranks in shard groups of 2; rank 2 dies and there is no room to replace it: 3 ranks do
    # not split into groups of 2, so the job goes on as FSDP. A recruited rank brings it back
    # to 4, and HSDP.
    pool = pool_with(die={2: 3}, capacity=0)
    ckpt = {"dir": str(tmp_path / "ckpt"), "every": 2}
    c = controller(
        pool=pool,
        workers=(3, 4),
        strategy="hsdp",
        shard_size=2,
        checkpoint=ckpt,
        global_batch_size=8,
        report_every=1,
    )
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        states = drive(c, limit=4)
        assert [type(s) for s in states] == [Starting, Running, Healing, Running], states
        assert c.world.decision is not None and c.world.decision.strategy == "fsdp"
        assert len(c.pool.ranks) == 3
        c.pool.spares.append(c.pool._new("spare"))
        grown = c.next_state(states[-1])
        assert isinstance(grown, Resizing)
        after = c.next_state(grown)
        assert isinstance(after, Running) and len(c.pool.ranks) == 4
        assert c.world.decision.strategy == "hsdp" and c.world.decision.mesh(4) == (2, 2)
        assert isinstance(drive(c, start=after)[-1], Finished)
    # Rank 0 was in every world: hsdp at 4, fsdp at 3 (from step 2's checkpoint), hsdp at 4
    # (from the checkpoint saved as the world grew).
    rank0 = c.pool.ranks[0]
    assert [(s, n) for s, _, n in rank0.prepared] == [("hsdp", 4), ("fsdp", 3), ("hsdp", 4)]
    resumes = [Path(r).name if r else None for _, r, _ in rank0.prepared]
    grew_at = int(resumes[2].split("-")[1])
    assert resumes[:2] == [None, "step-00000002"] and grew_at >= 2, resumes
    said = [r.getMessage() for r in caplog.records if r.name == "raymesh"]
    assert any("fsdp over 3 ranks: the world of 3 no longer splits" in m for m in said), said
    assert [h["step"] for h in c.log.history] == list(range(1, 9))


def test_an_elastic_hsdp_job_with_room_for_fewer_starts_as_fsdp_and_grows_back_to_hsdp(
    tmp_path,
):
    # workers=(2, 4): "starts with max (or with what fits, if at least min)". With room for 2,
    # 2 ranks are one shard group, not two: it must start as FSDP (as a shrunk HSDP job goes
    # on), and become HSDP once it grows to 4.
    placer = type("Placer", (FakePlacer,), {"room": 2})
    ckpt = {"dir": str(tmp_path / "ckpt"), "every": 2}
    c = controller(
        placer=placer,
        workers=(2, 4),
        strategy="hsdp",
        shard_size=2,
        checkpoint=ckpt,
        replace_timeout_s=0.5,
        report_every=1,
    )
    states = drive(c, limit=2)
    assert isinstance(states[-1], Running), states[-1]
    assert len(c.pool.ranks) == 2 and c.world.decision.strategy == "fsdp"
    c.pool.spares += [c.pool._new("spare"), c.pool._new("spare")]
    states = drive(c, start=states[-1])
    assert [type(s) for s in states] == [Running, Resizing, Running, Finishing, Finished]
    assert c.world.decision.strategy == "hsdp" and len(c.pool.ranks) == 4


def test_an_elastic_job_with_room_for_fewer_starts_with_what_fits_and_grows_to_max():
    placer = type("Placer", (FakePlacer,), {"room": 2})
    c = controller(placer=placer, workers=(2, 3), global_batch_size=6, replace_timeout_s=0.5)
    states = drive(c, limit=2)
    assert isinstance(states[-1], Running) and len(c.pool.ranks) == 2
    c.pool.spares.append(c.pool._new("spare"))
    states = drive(c, start=states[-1])
    assert [type(s) for s in states] == [Running, Resizing, Running, Finishing, Finished]
    assert len(c.pool.ranks) == 3 and [h["step"] for h in c.log.history] == list(range(1, 9))


@pytest.mark.parametrize("error", [ValueError("no completion scored\nthe detail"), None])
def test_a_driven_job_its_loop_ends_tells_its_run_folder_how_and_why(tmp_path, error):
    config = TrainConfig(workers=2, steps=8, global_batch_size=4, run_dir=str(tmp_path))
    fake = FakePlacer(config)
    c = TrainController(
        config,
        placer=fake,
        pool=FakePool(lambda ctx: None, config, fake, None),
        policies=Policies.of(config.failure),
        driven=True,
        labels={"kind": "rl", "algorithm": "GRPO"},
    )
    c.open(None)
    job = DrivenJob(c)
    job.tell("role", role="generators", count=2)  # the loop's own event
    with pytest.raises(ValueError, match=r"^tell: event='state': the job writes its own"):
        job.tell("state", state="Finished")
    job.stop(error)
    c.stop(ValueError("later"))  # nothing once ended
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (events[0]["event"], events[0]["kind"], events[0]["algorithm"]) == ("job", "rl", "GRPO")
    assert [e["count"] for e in events if e["event"] == "role"] == [2]
    ends = [e for e in events if e["event"] == "end"]
    if error is None:
        assert [(e["state"], e["reason"]) for e in ends] == [("Stopped", "stopped by its loop")]
    else:
        reason = "its loop failed: ValueError: no completion scored"
        assert [(e["state"], e["reason"]) for e in ends] == [("Failed", reason)]
    assert c.pool.closed and not c.pool.reused
