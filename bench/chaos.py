"""The chaos campaign: faults at random across raymesh, each run checked against its promise.

    python bench/chaos.py                   # the full campaign (>= 50 faulted training runs)
    python bench/chaos.py --quick           # a smoke run, a few minutes on 2 cores
    python bench/chaos.py --seed 7          # another campaign (default seed 0)
    python bench/chaos.py --only ddp --replay 1234   # one run again, from its printed seed
    python bench/chaos.py --save            # also write bench/results/chaos.json
    python bench/chaos.py --rate            # a SIGKILL every 30 s for 10 minutes (chaos_rate.py)

Every run draws its faults from its own seed, printed with it (stderr, and in the JSON), so a
run whose promise broke replays alone with `--only SUITE --replay SEED`. The suites and the
promise each run is checked against:
- ddp: 2 and 4 ranks, with and without a warm spare; 1-3 faults (SIGKILL, a raised error, a
  hang) at random ranks and steps, two at once sometimes: the final weights are bitwise the
  fault-free run's at the same world size, and every step is in the history once. A run whose
  faults take every rank at one step has nothing to heal from (no checkpoint): its promise is
  a TrainError naming CheckpointConfig.
- fsdp, hsdp: 4 ranks, a checkpoint every 4 steps, 1-2 SIGKILLs at random: every rank reloads
  the newest checkpoint, resharded, and the final weights are bitwise the fault-free run's (a
  rank lost before the first checkpoint: a TrainError naming CheckpointConfig).
- data: a pipeline (random augmentation on 2 preprocessing procs) whose procs are SIGKILLed at
  random moments: bitwise the same pipeline's run without kills.
- tune: a grid study of 4 trials (2-rank DDP jobs, one learning rate each) with 1-2 faults
  at random ranks and steps in every trial: each trial's value is bitwise the fault-free
  study's for its learning rate. And the same study from `raymesh tune job.toml`, its
  controller SIGKILLed with trial 2, 3 or 4 in flight (0-50 ms after it is seen running),
  then `--resume`d: every grid point complete exactly once, the trials finished before the
  kill kept as they were, every value the fault-free study's.
- serve: the example MLP on 3 replicas under 4 clients' steady load; 1-3 replicas SIGKILLed
  and one reload to other weights, at random moments: every request answered 200, each
  answer the old or the new weights' (to float precision), never anything else.
- federated: 6 rounds of FedAvg over fedmlp's 6 or 8 clients on 2 client procs, as
  `raymesh.federated.run` runs them, secure aggregation on in half the runs; 1-2 procs
  SIGKILLed at random rounds and moments (0-50 ms after a round's Advertise, ShareSeeds, Fit
  or Unmask went out: a replay draws the same, where in the procs' work it lands is timing);
  rogue clients: tests/federated/helpers.faulty's (client 3 raises, client 5
  sends NaN) in most runs and, in half the secure runs, an edge server with an honest edge
  client and tests/federated/test_rogue.py's Rogue, playing one of its acts (or honestly)
  each round: every applied round is within 1e-6 of FedAvg by hand (as
  helpers.fedavg_by_hand, from that round's starting weights) over the clients not dropped,
  no rogue's bad update among them; a round not applied says why and leaves the model as it
  was; every killed proc is replaced, and all 6 rounds run. Its "lost steps" are the rounds
  not applied.
- elastic (full campaign only, ~1 min a run): a 3-node local cluster (`ray.cluster_utils`)
  loses a node with 2 of 4 ranks at a random step; the job shrinks to 2 and grows back to 4
  when a node joins: every step in the history once, the weights equal to the fault-free run's
  to float precision (the reductions ran at other world sizes in between). The script is
  tests/train/test_elastic.py's, there at one fixed step.
- rl (bench/chaos_rl.py): GRPO runs with generators, reward actors or the controller
  SIGKILLed at random, at max_staleness 0 and 1; the promises are in that module.
The training jobs are the example MLP (raymesh.examples.mlp:build), 16 steps of 48 samples,
reported every 2 steps, in procs kept warm across the runs of a suite (`train.WarmRanks`, as a
user's sweep would), on the local Ray that raymesh starts. Progress goes to stderr; one JSON
object (the summary table and every run) to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the data suite's transforms live in tests.data.helpers

from chaos_rl import rl_runs  # noqa: E402  (bench/ is the script's folder, on sys.path)

MLP = "raymesh.examples.mlp:build"
STEPS, BATCH, EVERY = 16, 48, 2


def log(msg: str) -> None:
    print(f"[chaos] {msg}", file=sys.stderr, flush=True)


@dataclasses.dataclass
class Run:
    """One faulted run and what it showed."""

    suite: str
    case: str
    seed: int
    faults: list[str]
    failures: int = 0  # failures the job recorded (stuck survivors excluded)
    healed: int = 0  # of which healed (replaced or shrunk)
    held: bool = False  # the promise held
    lost_steps: int = 0  # steps trained twice (recomputed)
    seconds: float = 0.0
    detail: str = ""


def differing(a: dict, b: dict) -> list[str]:
    import torch

    return [k for k in a if k not in b or not torch.equal(a[k], b[k])]


def config(**kw: Any) -> Any:
    from raymesh import train

    base: dict[str, Any] = dict(
        workers=2, steps=STEPS, global_batch_size=BATCH, seed=0, report_every=EVERY
    )
    base.update(kw)
    return train.TrainConfig(**base)


def draw_faults(rng: random.Random, workers: int, n: int) -> list[Any]:
    """`n` faults at distinct (rank, step) places, of random kinds, at random steps."""
    from raymesh.testing import fail, hang, kill

    places: set[tuple[int, int]] = set()
    while len(places) < n:
        places.add((rng.randrange(workers), rng.randint(1, STEPS)))
    makers: list[Callable[..., Any]] = [kill, kill, fail, hang]  # kills the commonest
    return [rng.choice(makers)(rank=r, at_step=s) for r, s in sorted(places, key=lambda p: p[1])]


def judge(run: Run, result: Any, reference: dict, t0: float) -> Run:
    """Fill `run` from a finished job against the fault-free weights."""
    counted = [f for f in result.failures if f.kind != "stuck"]
    run.failures = len(counted)
    run.healed = sum(f.action in ("replace", "shrink") for f in counted)
    run.lost_steps = sum(f.steps_recomputed or 0 for f in result.failures)
    steps_ok = [h["step"] for h in result.history] == list(range(1, STEPS + 1))
    diff = differing(reference, result.state_dict())
    run.held = steps_ok and not diff
    if not run.held:
        run.detail = f"steps in history ok: {steps_ok}; tensors differing: {diff[:6]}"
    run.seconds = round(time.monotonic() - t0, 2)
    return run


def ddp_runs(seed: int, count: int, replay: int | None) -> Iterator[Run]:
    from raymesh import train

    rng = random.Random(seed)
    cases = [(w, s) for w in (2, 4) for s in (0, 1)]
    with train.WarmRanks() as warm:
        refs = {w: train.fit(MLP, config(workers=w), warm=warm).state_dict() for w in (2, 4)}
        for _ in range(count):
            run_seed = replay if replay is not None else rng.randrange(1 << 30)
            r = random.Random(run_seed)
            workers, spares = r.choice(cases)  # from the run's seed alone: replays draw it again
            faults = draw_faults(r, workers, r.randint(1, 3))
            run = Run(
                "ddp", f"{workers} ranks, spares={spares}", run_seed, [str(f) for f in faults]
            )
            log(f"ddp seed={run_seed}: {run.case}: {', '.join(run.faults)}")
            # Every rank lost at one step leaves no state to heal from (no checkpoint here):
            # the promise is then a TrainError that names the fix.
            wipeout = any(
                {f.rank for f in faults if f.at_step == step} == set(range(workers))
                for step in {f.at_step for f in faults}
            )
            t0 = time.monotonic()
            try:
                result = train.fit(
                    MLP,
                    config(
                        workers=workers,
                        spares=spares,
                        faults=faults,
                        max_failures=len(faults) + 1,
                        step_timeout_s=2.0,  # a hang is found in 2 s (steps take milliseconds)
                    ),
                    warm=warm,
                )
            except train.TrainError as e:
                run.held = wipeout and "no checkpoint to heal from" in str(e)
                run.failures = workers
                run.detail = f"TrainError: {e}" if not run.held else "every rank lost: TrainError"
                run.seconds = round(time.monotonic() - t0, 2)
                yield run
                continue
            yield judge(run, result, refs[workers], t0)


def sharded_runs(strategy: str, seed: int, count: int, replay: int | None) -> Iterator[Run]:
    from raymesh import train
    from raymesh.testing import kill

    rng = random.Random(seed)
    extra: dict[str, Any] = {"shard_size": 2} if strategy == "hsdp" else {}
    with tempfile.TemporaryDirectory(prefix="raymesh-chaos-") as tmp, train.WarmRanks() as warm:

        def job(name: str, **kw: Any) -> Any:
            ckpt = train.CheckpointConfig(dir=f"{tmp}/{name}", every=4)
            cfg = config(workers=4, strategy=strategy, checkpoint=ckpt, **extra, **kw)
            return train.fit(MLP, cfg, warm=warm)

        reference = job("reference").state_dict()
        for i in range(count):
            run_seed = replay if replay is not None else rng.randrange(1 << 30)
            r = random.Random(run_seed)
            places = sorted(
                {(r.randrange(4), r.randint(2, STEPS)) for _ in range(r.randint(1, 2))},
                key=lambda p: p[1],
            )
            faults = [kill(rank=rank, at_step=step) for rank, step in places]
            run = Run(strategy, "4 ranks, checkpoint every 4", run_seed, [str(f) for f in faults])
            log(f"{strategy} seed={run_seed}: {', '.join(run.faults)}")
            t0 = time.monotonic()
            try:
                result = job(f"run-{i}", faults=faults, max_failures=len(faults) + 1)
            except train.TrainError as e:
                # Shards die with their rank: lost before the first checkpoint (step 4), the
                # promise is a TrainError naming the fix.
                run.held = places[0][1] <= 4 and "no checkpoint to heal from" in str(e)
                run.failures = 1
                run.detail = "lost before the first checkpoint: TrainError" if run.held else str(e)
                run.seconds = round(time.monotonic() - t0, 2)
                yield run
                continue
            yield judge(run, result, reference, t0)


def data_runs(seed: int, count: int, replay: int | None) -> Iterator[Run]:
    from raymesh import data, train
    from tests.data.helpers import RecordPid, build_without_data, teacher

    del build_without_data  # imported here so a missing tests package fails before any run
    build = "tests.data.helpers:build_without_data"
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="raymesh-chaos-") as tmp:

        def pipeline(folder: str) -> Any:
            Path(folder).mkdir(parents=True, exist_ok=True)
            return data.Pipeline(
                source=teacher(), transform=RecordPid(folder), workers=2, prefetch=2
            )

        reference = train.fit(build, config(data=pipeline(f"{tmp}/reference"))).state_dict()
        for i in range(count):
            run_seed = replay if replay is not None else rng.randrange(1 << 30)
            r = random.Random(run_seed)
            kills = r.randint(1, 2)
            delays = sorted(r.uniform(0.0, 1.5) for _ in range(kills))
            folder = f"{tmp}/run-{i}"
            run = Run(
                "data",
                "2 preprocessing procs, augmented",
                run_seed,
                [f"SIGKILL a preprocessing proc {d:.2f}s after its first batch" for d in delays],
            )
            log(f"data seed={run_seed}: {', '.join(run.faults)}")
            killed: list[int] = []
            stop = threading.Event()
            pipe = pipeline(folder)  # makes the folder the procs note their pids in
            args = (Path(folder), delays, random.Random(run_seed), killed, stop)
            thread = threading.Thread(target=kill_preprocessing, args=args, daemon=True)
            t0 = time.monotonic()
            thread.start()
            result = train.fit(build, config(data=pipe))
            stop.set()
            thread.join(timeout=10)
            run.faults = run.faults[: len(killed)]  # the run may end before a late one
            diff = differing(reference, result.state_dict())
            run.failures = len(killed)
            run.healed = result.data.replaced if result.data is not None else 0
            run.held = not diff and not result.failures
            run.detail = "" if run.held else f"tensors differing: {diff[:6]}"
            run.seconds = round(time.monotonic() - t0, 2)
            yield run


def kill_preprocessing(
    pids: Path, delays: list[float], rng: random.Random, killed: list[int], stop: threading.Event
) -> None:
    """SIGKILL a preprocessing proc (they note their pids in `pids`) at each of `delays`
    seconds after the first one made a batch, until `stop`."""
    while not any(pids.iterdir()):
        if stop.wait(0.01):
            return
    start = time.monotonic()
    for d in delays:
        if stop.wait(max(0.0, start + d - time.monotonic())):
            return
        alive = sorted(int(p.name) for p in pids.iterdir() if int(p.name) not in killed)
        if alive:
            pid = rng.choice(alive)
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass


def elastic_runs(seed: int, count: int, replay: int | None) -> Iterator[Run]:
    from tests.scripts import run_cluster_script
    from tests.train.test_elastic import ELASTIC

    rng = random.Random(seed)
    steps = 120
    with tempfile.TemporaryDirectory(prefix="raymesh-chaos-") as tmp:
        for i in range(count):
            run_seed = replay if replay is not None else rng.randrange(1 << 30)
            at = random.Random(run_seed).randint(8, 80)
            script = ELASTIC.replace("STEPS", str(steps)).replace("REMOVE_AT", str(at))
            run = Run("elastic", "3 nodes, workers=(2, 4)", run_seed, [f"node lost at step {at}"])
            log(f"elastic seed={run_seed}: {run.faults[0]}")
            t0 = time.monotonic()
            got = run_cluster_script(Path(tmp) / f"elastic-{i}.py", script, timeout=400)
            worlds = [w for _, w in got["worlds"]]
            run.failures = len([f for f in got["failures"] if f[1] != "stuck"])
            run.healed = run.failures
            run.held = (
                got["steps"] == list(range(1, steps + 1))
                and got["differ"] == []
                and 2 in worlds
                and worlds[-1] == 4
            )
            run.detail = "" if run.held else json.dumps({k: got[k] for k in ("worlds", "differ")})
            run.seconds = round(time.monotonic() - t0, 2)
            yield run


LRS = [0.01, 0.03, 0.1, 0.3]
STUDY_JOB = """
build = "tests.tune.helpers:mlp_lr"
workers = 2
steps = {steps}
global_batch_size = {batch}
report_every = {every}
seed = 0

[checkpoint]
dir = "{folder}/unused"
every = 4

[tune]
trials = {trials}
concurrent = 1
sampler = "grid"
scheduler = "none"
storage = "{folder}/study.db"

[tune.space]
lr = "choice({lrs})"
"""


def trials(db: str) -> list[Any]:
    """The trials of the study in `db` so far (none before it exists). Not before the study
    made its file: opening the storage would create it, and `raymesh tune` (rightly) refuses
    a storage that already exists without --resume (the kills of earlier campaigns missed so:
    the controller had exited at once, and --resume ran the whole study)."""
    import optuna

    if not Path(db.removeprefix("sqlite:///")).exists():
        return []
    try:
        return optuna.load_study(study_name="raymesh", storage=db).get_trials()
    except Exception:  # not created yet
        return []


def tune_runs(seed: int, count: int, replay: int | None) -> Iterator[Run]:
    from raymesh import tune
    from raymesh._src import backend
    from tests.scripts import start_cli

    build = "tests.tune.helpers:mlp_lr"
    rng = random.Random(seed)

    def study(faults: list[Any]) -> dict[float, float | None]:
        cfg = config(faults=faults, max_failures=len(faults) + 1, step_timeout_s=2.0)
        done = tune.run(
            build, cfg, space={"lr": tune.choice(LRS)}, trials=4, sampler="grid", scheduler=None
        )
        return {t.params["lr"]: t.value for t in done.trials}

    reference = study([])
    with tempfile.TemporaryDirectory(prefix="raymesh-chaos-") as tmp:
        for i in range(count):
            run_seed = replay if replay is not None else rng.randrange(1 << 30)
            r = random.Random(run_seed)
            t0 = time.monotonic()
            if r.random() < 0.5:  # faults in every trial
                faults = draw_faults(r, 2, r.randint(1, 2))
                run = Run("tune", "4 trials, faults in each", run_seed, [str(f) for f in faults])
                log(f"tune seed={run_seed}: {run.case}: {', '.join(run.faults)}")
                got = study(faults)
                run.failures = run.healed = 4 * len(faults)
                run.held = got == reference
                run.detail = "" if run.held else f"values {got} vs fault-free {reference}"
            else:  # the study's controller SIGKILLed, then resumed
                # Into trial k+1 of 4, after k ended: a trial in flight when the controller
                # goes (a fixed delay after the first trial ended often outlived the study).
                # (A trial of 16 steps takes ~0.1 s in warm procs: kill within 50 ms of
                # seeing it run.)
                k, delay = r.randint(1, 3), r.uniform(0.0, 0.05)
                folder = Path(tmp) / f"study-{i}"
                folder.mkdir()
                job = folder / "study.toml"
                job.write_text(
                    STUDY_JOB.format(
                        steps=STEPS, batch=BATCH, every=EVERY, folder=folder, trials=4, lrs=LRS
                    )
                )
                what = f"SIGKILL the study's controller {delay:.3f}s into trial {k + 1} of 4"
                run = Run("tune", "raymesh tune, controller killed", run_seed, [what])
                log(f"tune seed={run_seed}: {what}")
                db = f"sqlite:///{folder}/study.db"
                cli = start_cli(["tune", str(job)], folder / "controller.log", cwd=ROOT)

                deadline = time.monotonic() + 300
                while cli.poll() is None and time.monotonic() < deadline:
                    states = [t.state.name for t in trials(db)]
                    if states.count("COMPLETE") >= k and "RUNNING" in states:
                        break
                    time.sleep(0.01)
                time.sleep(delay)
                if cli.poll() is None:
                    cli.send_signal(signal.SIGKILL)
                    run.failures = run.healed = 1
                else:
                    run.faults = []  # it ended first
                cli.wait(timeout=60)
                before = {t.number: t.value for t in trials(db) if t.state.name == "COMPLETE"}
                resumed = subprocess.run(
                    [sys.executable, "-m", "raymesh.cli.main", "tune", str(job), "--resume"],
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    env=dict(os.environ, RAYMESH_ADDRESS=backend.address()),
                )
                after = [t for t in trials(db) if t.state.name == "COMPLETE"]
                got = {t.params["lr"]: t.value for t in after}
                run.held = (
                    resumed.returncode == 0
                    and sorted(t.params["lr"] for t in after) == sorted(LRS)
                    and {t.number: t.value for t in after if t.number in before} == before
                    and got == reference
                )
                run.detail = "" if run.held else f"{got} vs {reference}; {resumed.stderr[-500:]}"
            run.seconds = round(time.monotonic() - t0, 2)
            yield run


def keep_asking(
    url: str, xs: list[list[float]], k: int, answers: list[Any], stop: threading.Event
) -> None:
    """POST xs[k], xs[k+1], ... to /v1/predict until `stop`; (input, status, body) each."""
    from tests.serve.helpers import Client

    client = Client(url)
    i = k
    while not stop.is_set():
        try:
            status, _, body = client.post("/v1/predict", {"x": xs[i % len(xs)]})
        except OSError as e:
            status, body = 0, repr(e)
            client = Client(url)
        answers.append((i % len(xs), status, body))
        i += 1


def serve_runs(seed: int, count: int, replay: int | None) -> Iterator[Run]:
    import torch

    from raymesh import serve
    from tests.serve.helpers import mlp_checkpoint, mlp_outputs

    xs = [[0.01 * (i + j) for j in range(32)] for i in range(8)]
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="raymesh-chaos-") as tmp:
        a, b = mlp_checkpoint(Path(tmp) / "a", seed=1), mlp_checkpoint(Path(tmp) / "b", seed=2)
        weights = {"a": mlp_outputs(a, xs), "b": mlp_outputs(b, xs)}

        def which(i: int, body: Any) -> str:
            try:
                y = torch.tensor(body["y"])
            except (KeyError, TypeError, ValueError):
                return f"not an answer: {str(body)[:200]}"
            for name, outputs in weights.items():
                if torch.allclose(y, torch.tensor(outputs[i]), atol=1e-5, rtol=1e-5):
                    return name
            return f"wrong: {str(body)[:200]}"

        for _ in range(count):
            run_seed = replay if replay is not None else rng.randrange(1 << 30)
            r = random.Random(run_seed)
            kills = sorted(r.uniform(0.2, 3.0) for _ in range(r.randint(1, 3)))
            reload_at = r.uniform(0.2, 3.0)
            faults = [f"SIGKILL a replica at {t:.2f}s" for t in kills]
            faults.append(f"reload to other weights at {reload_at:.2f}s")
            run = Run("serve", "3 replicas, 4 clients", run_seed, faults)
            log(f"serve seed={run_seed}: {', '.join(faults)}")
            t0 = time.monotonic()
            app = serve.deploy(
                build="raymesh.examples.mlp:build",
                checkpoint=str(a),
                replicas=3,
                max_batch_size=16,
                batch_wait_ms=5,
                port=0,
            )
            answers: list[tuple[int, int, Any]] = []
            stop = threading.Event()

            clients = [
                threading.Thread(target=keep_asking, args=(app.url, xs, k, answers, stop))
                for k in range(4)
            ]
            for c in clients:
                c.start()
            try:
                start, killed = time.monotonic(), 0
                events = sorted([(t, "kill") for t in kills] + [(reload_at, "reload")])
                for at, what in events:
                    time.sleep(max(0.0, start + at - time.monotonic()))
                    if what == "kill":
                        pids = app.replica_pids()
                        if pids:
                            os.kill(r.choice(sorted(pids)), signal.SIGKILL)
                            killed += 1
                    else:
                        app.reload(str(b))
                settled = time.monotonic() + 60  # the replacements up, then more answers
                while len(app.replica_pids()) < 3 and time.monotonic() < settled:
                    time.sleep(0.1)
                after = len(answers)
                while len(answers) < after + 40 and time.monotonic() < settled:
                    time.sleep(0.05)
            finally:
                stop.set()
                for c in clients:
                    c.join(timeout=60)
                stats = app.stats()
                app.stop()
            seen = [
                which(i, body) if status == 200 else f"status {status}: {body}"
                for i, status, body in answers
            ]
            bad = [x for x in seen if x not in ("a", "b")]
            last = seen[after + len(clients) :]
            run.failures = killed
            run.healed = int(stats.get("replaced", 0))
            run.held = not bad and bool(last) and set(last) == {"b"}
            run.detail = "" if run.held else f"{len(bad)} bad answers: {bad[:3]}; last {last[:3]}"
            run.seconds = round(time.monotonic() - t0, 2)
            yield run


FED_ROUNDS, FED_HOSTS = 6, 2  # 6: the rounds tests/federated/test_rogue.py's Rogue plays
FED_TOKEN = "chaos-federated-token"
FED_STEPS = ("Advertise", "ShareSeeds", "Fit", "Unmask")  # a secure round's; a plain one: Fit
# test_rogue's edge rogue's plays for a round: those after which its update still counts (it
# trained honestly, then lied with its shares or answered at another's address), and those
# that must keep it out of the round.
COUNTED = ["honestly", "a_bad_unmask", "b_wrong_shares", "b_answers_for_another"]
KEPT_OUT = [
    "a_low_order_key",
    "a_cut_share",
    "a_bad_figures",
    "a_oversized",
    "a_deep",
    "b_pretends",
    "b_huge_count",
    "b_old_round",
    "b_chunked",
]


@dataclasses.dataclass
class ProcKill:
    """SIGKILL client proc `host` `delay` s after round `round`'s `step` message went out."""

    round: int
    step: str
    host: int
    delay: float
    due: bool = False  # its step came: the kill is on its timer
    pid: int = 0  # the pid killed, once it was

    def __str__(self) -> str:
        return (
            f"SIGKILL client proc {self.host} {self.delay:.3f}s into round {self.round}'s "
            f"{self.step}" + (f" (pid {self.pid})" if self.pid else "")
        )


@dataclasses.dataclass
class FedDraw:
    """One federated run's layout and faults, drawn from its seed alone."""

    secure: bool
    clients: int
    faulty: bool  # tests.federated.helpers.faulty: RAISES raises, NAN sends NaN
    fraction: float
    seed: int  # the federation's sampling seed
    kills: list[ProcKill]
    script: list[str]  # the edge rogue's play each round; [] for no edge server

    @classmethod
    def of(cls, run_seed: int) -> FedDraw:
        r = random.Random(run_seed)
        secure = r.random() < 0.5
        clients = r.choice((6, 8))
        faulty = r.random() < 0.75
        edge = secure and r.random() < 0.5  # test_rogue's plays are secure rounds'
        fraction = 1.0 if edge else r.choice((0.5, 0.75, 1.0))  # the edge rogue plays all
        seed = r.randrange(1 << 16)
        kills = [  # in distinct rounds before the last, so each dead proc is found
            ProcKill(
                at,
                r.choice(FED_STEPS) if secure else "Fit",
                r.randrange(FED_HOSTS),
                r.uniform(0, 0.05),
            )
            for at in sorted(r.sample(range(1, FED_ROUNDS), r.randint(1, 2)))
        ]
        script: list[str] = []
        for _ in range(FED_ROUNDS if edge else 0):
            pool = COUNTED + KEPT_OUT
            if "b_wrong_shares" not in script:
                pool.remove("b_old_round")  # it replays the adverts b_wrong_shares kept
            script.append(r.choice(pool))
        return cls(secure, clients, faulty, fraction, seed, kills, script)

    def rogues(self) -> dict[int, str]:
        from tests.federated import helpers

        return {helpers.RAISES: "raises", helpers.NAN: "sends NaN"} if self.faulty else {}

    def case(self) -> str:
        return (
            f"{self.clients} clients on {FED_HOSTS} procs, secure={self.secure}, "
            f"fraction={self.fraction}, {'faulty' if self.faulty else 'honest'} clients"
            + (", an edge server with an honest and a rogue edge client" if self.script else "")
        )

    def faults(self, done: bool = False) -> list[str]:
        """What is injected; once the run is `done`, only the kills that landed."""
        out = [str(k) for k in self.kills if k.pid or not done]
        out += [f"client {c} {what} whenever sampled" for c, what in self.rogues().items()]
        out += [
            f"edge rogue {self.clients} in round {i}: {play}"  # it joins first: cid `clients`
            for i, play in enumerate(self.script, start=1)
            if play != "honestly"
        ]
        return out


def federation(draw: FedDraw) -> Any:
    """raymesh.federated's Federation (what `raymesh.federated.run` runs) for `draw`, which
    also notes each round's sampled clients and SIGKILLs a client proc when a round's step
    reaches a moment drawn for it."""
    from raymesh import federated as fl
    from raymesh.examples import fedmlp
    from raymesh.federated.federation import Federation
    from tests.federated import helpers

    class Chaotic(Federation):
        def __init__(self, *args: Any, **kw: Any) -> None:
            self.sampled: dict[int, list[int]] = {}  # round -> its sampled clients
            self.timers: list[threading.Timer] = []
            super().__init__(*args, **kw)

        def _assign(self, sampled: Any) -> Any:
            self.sampled[len(self.sampled) + 1] = sorted(sampled)
            return super()._assign(sampled)

        def _exchange(self, msgs: Any, dropped: Any) -> Any:
            if msgs:
                msg = next(iter(msgs.values()))[0]
                for k in draw.kills:
                    if (k.round, k.step) == (msg.round, type(msg).__name__) and not k.due:
                        k.due = True
                        self.timers.append(threading.Timer(k.delay, self._kill, args=(k,)))
                        self.timers[-1].start()
            return super()._exchange(msgs, dropped)

        def _kill(self, k: ProcKill) -> None:
            pid = self.hosts[k.host].pid
            try:
                os.kill(pid, signal.SIGKILL)
                k.pid = pid
            except ProcessLookupError:  # gone already: nothing injected
                pass

    edge = None
    if draw.script:
        edge = fl.EdgeConfig(
            token=FED_TOKEN,
            wait_for=2,
            join_timeout_s=60,
            poll_s=10,  # sampled while heard from within 3 polls: more than a respawn
            max_body_bytes=128 << 10,  # test_rogue's a_oversized sends 256 KiB
            max_clients=2,
        )
    return Chaotic(
        helpers.faulty if draw.faulty else fedmlp.client_fn,
        fl.FedAvg(fraction=draw.fraction, min_clients=2),
        fl.RunConfig(
            clients=draw.clients,
            rounds=FED_ROUNDS,
            hosts=FED_HOSTS,
            secure_aggregation=draw.secure,
            timeout_s=30.0,  # a replacement's first Fit takes seconds on 2 cores
            seed=draw.seed,
            edge=edge,
        ),
    )


def edge_rogue(fed: Any, draw: FedDraw, finished: list[threading.Event]) -> Any:
    """test_rogue's Rogue at `fed`'s edge server, playing `draw.script` (joined first, so its
    client id is `draw.clients`), and an honest EdgeClient beside it; the Rogue, started."""
    from raymesh.examples import fedmlp
    from raymesh.federated.edge.device import EdgeClient
    from tests.federated import helpers, test_rogue

    raw = helpers.RawEdge(fed.edge.url, FED_TOKEN)
    status, body = raw.join("rogue")
    if status != 200 or raw.cid != draw.clients:
        raise RuntimeError(f"the edge rogue could not join as {draw.clients}: {status} {body}")
    honest = EdgeClient(fed.edge.url, FED_TOKEN, fedmlp.client_fn, device="honest")
    threading.Thread(target=honest.run, daemon=True).start()

    def other() -> Any:  # the honest edge client, joined by the time a round runs
        return types.SimpleNamespace(cid=honest.cid)

    plays: dict[str, Callable[[Any], None]] = {
        name: getattr(test_rogue, name) for name in KEPT_OUT + COUNTED if name != "honestly"
    }
    plays["honestly"] = test_rogue.Rogue.honestly
    plays["b_pretends"] = lambda g: test_rogue.b_pretends(g, other())
    plays["b_answers_for_another"] = lambda g: test_rogue.b_answers_for_another(g, other())
    scripts = {i: plays[play] for i, play in enumerate(draw.script, start=1)}
    after = {  # b_huge_count keeps its shares for this replay once the round is over
        i: test_rogue.b_replays_shares
        for i, play in enumerate(draw.script, start=1)
        if play == "b_huge_count"
    }
    rogue = test_rogue.Rogue(raw, scripts, after, finished)
    rogue.start()
    return rogue


def federated_run(run_seed: int) -> Run:
    import numpy as np

    from raymesh.examples import fedmlp
    from raymesh.federated.protocol.client import Layout
    from tests.federated import test_rogue
    from tests.federated.helpers import fedavg_round

    if test_rogue.ROUNDS != FED_ROUNDS:
        raise RuntimeError(f"test_rogue's Rogue plays {test_rogue.ROUNDS} rounds, not {FED_ROUNDS}")

    def flat(state: Any) -> Any:
        return Layout.of(state).flatten(state)

    draw = FedDraw.of(run_seed)
    run = Run("federated", draw.case(), run_seed, draw.faults())
    log(f"federated seed={run_seed}: {run.case}: {', '.join(run.faults)}")
    t0 = time.monotonic()
    problems: list[str] = []
    finished = [threading.Event() for _ in range(FED_ROUNDS + 1)]
    weights: list[Any] = []  # the global model before round 1, then after each round
    fed = rogue = result = None
    ran = False  # Federation.run stops the procs and the edge server itself

    def between_rounds(record: Any) -> None:
        weights.append(fed.weights.copy())
        finished[record.round].set()
        if rogue is not None and not rogue.ready[record.round].wait(60):
            problems.append(f"round {record.round}: the edge rogue did not finish its play")

    try:
        fed = federation(draw)
        weights.append(fed.weights.copy())
        if draw.script:
            rogue = edge_rogue(fed, draw, finished)
        ran = True
        result = fed.run(between_rounds)
    except Exception as e:  # the promise includes that the run completes
        problems.append(f"the run raised {type(e).__name__}: {str(e)[:300]}")
    finally:
        for ev in finished:
            ev.set()  # a rogue left waiting goes on (and ends: the server is gone)
        if fed is not None:
            for timer in fed.timers:
                timer.join(timeout=5)
            if not ran:
                fed.stop()
    run.faults = draw.faults(done=True)  # with the pids killed; not a kill whose step never came
    killed = sum(bool(k.pid) for k in draw.kills)
    rogues = draw.rogues()
    acts = refused = replaced = lost = 0
    gaps: list[float] = []
    history = result.history if result is not None else []
    if result is not None:
        if len(history) != FED_ROUNDS:
            problems.append(f"{len(history)} of {FED_ROUNDS} rounds ran")
        if not np.array_equal(weights[0], flat(fedmlp.build_model().state_dict())):
            problems.append("the run did not start from fedmlp's initial model")
        if not np.array_equal(flat(result.state_dict()), weights[-1]):
            problems.append("the final model is not the last round's")
    for rec in history:
        where, before, after = f"round {rec.round}", weights[rec.round - 1], weights[rec.round]
        sampled = fed.sampled.get(rec.round, [])
        survivors = [c for c in sampled if c not in rec.dropped]
        replaced += rec.replaced_hosts
        if len(sampled) != rec.sampled or len(survivors) != rec.responded:
            problems.append(
                f"{where}: the record says {rec.responded} of {rec.sampled} clients answered, "
                f"but {survivors} of {sampled} were not dropped"
            )
        unsaid = [c for c, why in rec.dropped.items() if not why]
        if unsaid:
            problems.append(f"{where}: clients {unsaid} dropped without a reason")
        for c in rogues:  # each time a simulated rogue got to answer (not on a dead proc)
            if c in sampled and "its proc failed" not in rec.dropped.get(c, ""):
                acts += 1
                refused += c in rec.dropped
                if c in survivors:
                    problems.append(f"{where}: rogue client {c}'s update was applied")
        if rec.applied:
            if rec.reason:
                problems.append(f"{where}: applied, yet with a reason: {rec.reason}")
            expected = fedavg_round(before, survivors, rec.round)
            gap = float(np.max(np.abs(after.astype(np.float64) - expected)))
            gaps.append(gap)
            model_ok = gap <= 1e-6
            if not model_ok:
                problems.append(
                    f"{where}: {gap:.3g} from FedAvg by hand over the survivors {survivors}"
                )
        else:
            lost += 1
            if not rec.reason:
                problems.append(f"{where}: not applied, and no reason given")
            model_ok = np.array_equal(before, after)
            if not model_ok:
                problems.append(f"{where}: not applied, yet the model moved")
        play = draw.script[rec.round - 1] if draw.script else "honestly"
        if play != "honestly":
            acts += 1
            cid, counted = draw.clients, play in COUNTED
            if (cid in survivors) != counted:
                problems.append(
                    f"{where}: the edge rogue ({play}) was "
                    f"{'not ' if counted else ''}counted: dropped {rec.dropped}"
                )
            if not counted:
                refused += cid in rec.dropped
            elif play == "b_wrong_shares":  # well-formed lies: only the model can tell
                refused += bool(model_ok)
            else:  # its update counts; what it did besides (its notes) was refused
                notes = [st for (i, _), (st, _) in rogue.seen.items() if i == rec.round]
                refused += all(st >= 400 or cid in rec.ignored for st in notes)
    if result is not None and replaced != killed:
        problems.append(f"{killed} client procs killed, {replaced} replaced")
    if rogue is not None and rogue.errors:
        problems.append(f"the edge rogue's play failed: {rogue.errors[0][-300:]}")
    skipped = "; ".join(
        f"round {h.round} not applied: {h.reason[:120]}" for h in history if not h.applied
    )
    log(
        f"  rounds applied {len(gaps)}/{len(history)}, largest gap to FedAvg by hand "
        f"{max(gaps, default=0.0):.2g}, {replaced} proc(s) replaced"
        + (f"; {skipped}" if skipped else "")
    )
    run.failures = killed + acts
    run.healed = replaced + refused
    run.lost_steps = lost
    run.held = not problems
    run.detail = "; ".join(problems)[:2000]
    run.seconds = round(time.monotonic() - t0, 2)
    return run


def federated_runs(seed: int, count: int, replay: int | None) -> Iterator[Run]:
    import torch

    # One thread, as the client procs train (ClientHost): the edge clients and FedAvg by hand
    # train tiny models in this process, which a second thread slows 30-fold on 2 cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rng = random.Random(seed)
        for _ in range(count):
            yield federated_run(replay if replay is not None else rng.randrange(1 << 30))
    finally:
        torch.set_num_threads(threads)


SUITES: dict[str, Callable[[int, int, int | None], Iterator[Run]]] = {
    "ddp": ddp_runs,
    "fsdp": lambda seed, n, replay: sharded_runs("fsdp", seed, n, replay),
    "hsdp": lambda seed, n, replay: sharded_runs("hsdp", seed, n, replay),
    "data": data_runs,
    "tune": tune_runs,
    "serve": serve_runs,
    "federated": federated_runs,
    "elastic": elastic_runs,
    "rl": lambda seed, n, replay: rl_runs(seed, n, replay, Run),
}
# Runs per suite: the full campaign has 40 + 8 + 8 + 4 + 2 = 62 faulted training runs, and
# tune's 4 studies (16 trials more).
FULL = {
    "ddp": 40,
    "fsdp": 8,
    "hsdp": 8,
    "data": 4,
    "tune": 4,
    "serve": 4,
    "federated": 4,
    "elastic": 2,
    "rl": 10,
}
QUICK = {
    "ddp": 4,
    "fsdp": 1,
    "hsdp": 1,
    "data": 1,
    "tune": 1,
    "serve": 1,
    "federated": 1,
    "elastic": 0,
    "rl": 5,
}


def table(runs: list[Run]) -> list[dict[str, Any]]:
    rows = []
    for suite in dict.fromkeys(r.suite for r in runs):
        mine = [r for r in runs if r.suite == suite]
        rows.append(
            {
                "suite": suite,
                "runs": len(mine),
                "faults_injected": sum(len(r.faults) for r in mine),
                "failures_recorded": sum(r.failures for r in mine),
                "healed": sum(r.healed for r in mine),
                "promise_held": f"{sum(r.held for r in mine)}/{len(mine)}",
                "lost_steps": sum(r.lost_steps for r in mine),
                "median_run_s": sorted(r.seconds for r in mine)[len(mine) // 2],
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a few runs per suite (CI's smoke run)")
    ap.add_argument("--seed", type=int, default=0, help="the campaign's seed")
    ap.add_argument("--only", default=",".join(SUITES), help=f"suites, of {','.join(SUITES)}")
    ap.add_argument("--replay", type=int, help="run only this run seed (with --only SUITE)")
    ap.add_argument("--save", action="store_true", help="write bench/results/chaos.json")
    ap.add_argument(
        "--rate",
        action="store_true",
        help="instead: the README's job under a SIGKILL every --every s (bench/chaos_rate.py)",
    )
    ap.add_argument("--minutes", type=float, default=10.0, help="--rate: each run's length")
    ap.add_argument("--every", type=float, default=30.0, help="--rate: seconds between kills")
    args = ap.parse_args()
    if args.rate:
        from chaos_rate import rate_run

        out = rate_run(minutes=args.minutes, every_s=args.every, seed=args.seed)
        text = json.dumps(out, indent=2)
        print(text)
        if args.save:
            (ROOT / "bench" / "results" / "chaos_rate.json").write_text(text + "\n")
        sys.exit(0 if out["held"] else 1)
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SUITES]
    if unknown:
        ap.error(f"--only {','.join(unknown)}: no such suite; use some of {','.join(SUITES)}")
    if args.replay is not None and len(only) != 1:
        ap.error("--replay SEED replays one run: name its suite with --only SUITE")
    counts = QUICK if args.quick else FULL
    load_before = os.getloadavg()
    t0 = time.monotonic()
    runs: list[Run] = []
    for suite in only:
        n = 1 if args.replay is not None else counts[suite]
        for run in SUITES[suite](args.seed, n, args.replay):
            verdict = "held" if run.held else f"BROKEN ({run.detail})"
            log(f"  -> {verdict}; {run.failures} failure(s), {run.seconds}s")
            runs.append(run)
    out = {
        "benchmark": "chaos",
        "quick": args.quick,
        "seed": args.seed,
        "summary": table(runs),
        "runs": [dataclasses.asdict(r) for r in runs],
        "all_held": all(r.held for r in runs),
        "wall_s": round(time.monotonic() - t0, 1),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "host": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }
    text = json.dumps(out, indent=2)
    print(text)
    if args.save:
        (ROOT / "bench" / "results" / "chaos.json").write_text(text + "\n")
    for row in out["summary"]:
        log(
            f"{row['suite']:5s} runs {row['runs']:3d}  faults {row['faults_injected']:3d}  "
            f"healed {row['healed']:3d}  held {row['promise_held']:>6s}  "
            f"lost steps {row['lost_steps']}"
        )
    sys.exit(0 if out["all_held"] else 1)


if __name__ == "__main__":
    main()
