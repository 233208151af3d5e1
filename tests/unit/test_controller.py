"""The training controller's run loop, driven state by state over a fake rank pool.

No Ray and no torch.distributed here: `FakePool` stands in for the rank pool (as Ray Train's
controller tests swap in a dummy worker group) and its ranks answer every endpoint at once, the
way real ranks would, including dying at a chosen step. What is tested is the controller's own
logic: which state follows which, what each carries, what is recorded.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from raymesh.actor import MeshFailure, SupervisionError
from raymesh.train import TooManyFailures, TrainConfig
from raymesh.train.controller import TrainController
from raymesh.train.estimate import MemoryEstimate
from raymesh.train.protocol import ChunkResult, RankStatus, ReplicaState, SetupInfo, StepMetrics
from raymesh.train.states import Failed, Finished, Finishing, Healing, Resizing, Running, Starting

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
                return Done(method(*args, **kwargs))
            except SupervisionError as e:
                return Done(error=e)

        return Endpoint(call)


@dataclasses.dataclass(eq=False)
class FakeRank:
    pool: FakePool
    name: str
    die_at: int | None = None  # the step (1-based) at which its proc dies
    node_id: str = "node-0"
    alive: bool = True
    grouped: bool = False  # in a process group (a peer's failure ends it, as in gloo)
    done: int = 0
    position: int = -1

    def __post_init__(self) -> None:
        self.worker = self.monitor = FakeWorker(self)

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
        self.position, self.grouped = rdv.rank, True
        est = MemoryEstimate(param_bytes=40, grad_bytes=40, optimizer_bytes=0, activation_bytes=8)
        return SetupInfo(params=10, device="cpu", estimate=est, budget_bytes=1 << 30)

    def ep_reform(self, rdv: Any) -> None:
        self.position, self.grouped = rdv.rank, True

    def ep_prepare(self, decision: Any, resume: str | None) -> int:
        return self.done

    def ep_get_state(self) -> ReplicaState:
        return ReplicaState(model={}, optim={}, done=self.done)

    def ep_set_state(self, state: ReplicaState) -> int:
        self.done = state.done
        return self.done

    def ep_run(self, start: int, stop: int, sizes: Any, feeders: Any = None) -> ChunkResult:
        if not self.grouped:  # a chunk queued behind a failed one
            return ChunkResult((), self.done, error="no process group", cause="peer")
        dying = [r.die_at for r in self.pool.ranks if r.die_at and start < r.die_at <= stop]
        end = min(dying, default=stop + 1) - 1  # the ranks complete the steps before a death
        metrics = tuple(
            StepMetrics(step=s, loss=float(s), step_s=0.01, end=0.0, compute_s=0.01, samples=1)
            for s in range(start + 1, end + 1)
        )
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
        return RankStatus(step=self.done, phase="done", phase_index=5, for_s=0.0, pid=1)

    def ep_finish(self, done: int, save: bool) -> dict[str, torch.Tensor] | None:
        return {"w": torch.tensor(float(done))} if self.position == 0 else None


class FakePlacer:
    def __init__(self, config: TrainConfig) -> None:
        self.gpus, self.plans, self.reason, self.topology = False, {}, None, None

    def place(self, n: int) -> list[str]:
        return ["node-0"] * n

    def comm_costs(self) -> dict[str, float]:
        return {}


class FakePool:
    """The rank pool: ranks spawn at once; `die` says which spawned rank dies at which step;
    `capacity` limits how many replacements there are."""

    die: dict[int, int] = {}
    capacity: int | None = None
    spares_ready = 0

    def __init__(self, build: Any, config: TrainConfig, placer: Any, warm: Any = None) -> None:
        self.config = config
        self.ranks: list[FakeRank] = []
        self.spawned: list[FakeRank] = []
        self.stopped: list[str] = []
        self.dead: list[str] = []
        self.spares: list[FakeRank] = []
        self.closed = False

    def _new(self, name: str) -> FakeRank:
        rank = FakeRank(self, f"{name}-{len(self.spawned)}", die_at=self.die.get(len(self.spawned)))
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
        self.closed = True


def controller(pool: type = FakePool, **overrides: Any) -> TrainController:
    cls = type("Controller", (TrainController,), {"placer_cls": FakePlacer, "rank_pool_cls": pool})
    config = TrainConfig(**{"workers": 2, "steps": 8, "global_batch_size": 4, **overrides})
    return cls(lambda ctx: None, config)


def pool_with(**attrs: Any) -> type:
    return type("Pool", (FakePool,), attrs)


def drive(c: TrainController, limit: int = 20) -> list[Any]:
    """Step the controller from Starting to a terminal state; every state it passed."""
    states: list[Any] = [Starting("test")]
    while not isinstance(states[-1], (Finished, Failed)) and len(states) < limit:
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
