"""The chaos campaign: faults at random across raymesh, each run checked against its promise.

    python bench/chaos.py                   # the full campaign (>= 50 faulted training runs)
    python bench/chaos.py --quick           # a smoke run, a few minutes on 2 cores
    python bench/chaos.py --seed 7          # another campaign (default seed 0)
    python bench/chaos.py --only ddp --replay 1234   # one run again, from its printed seed
    python bench/chaos.py --save            # also write bench/results/chaos.json

Every run draws its faults from its own seed, printed with it (stderr, and in the JSON), so a
run whose promise broke replays alone with `--only SUITE --replay SEED`. The suites and the
promise each run is checked against:
- ddp: 2 and 4 ranks, with and without a warm spare; 1-3 faults (SIGKILL, a raised error, a
  hang) at random ranks and steps, two at once sometimes: the final weights are bitwise the
  fault-free run's at the same world size, and every step is in the history once.
- fsdp, hsdp: 4 ranks, a checkpoint every 4 steps, 1-2 SIGKILLs at random: every rank reloads
  the newest checkpoint, resharded, and the final weights are bitwise the fault-free run's.
- data: a pipeline (random augmentation on 2 preprocessing procs) whose procs are SIGKILLed at
  random moments: bitwise the same pipeline's run without kills.
- elastic (full campaign only, ~1 min a run): a 3-node local cluster (`ray.cluster_utils`)
  loses a node with 2 of 4 ranks at a random step; the job shrinks to 2 and grows back to 4
  when a node joins: every step in the history once, the weights equal to the fault-free run's
  to float precision (the reductions ran at other world sizes in between). The script is
  tests/train/test_elastic.py's, there at one fixed step.
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
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the data suite's transforms live in tests.data.helpers

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


def equal(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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
            t0 = time.monotonic()
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
            result = job(f"run-{i}", faults=faults, max_failures=len(faults) + 1)
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


SUITES: dict[str, Callable[[int, int, int | None], Iterator[Run]]] = {
    "ddp": ddp_runs,
    "fsdp": lambda seed, n, replay: sharded_runs("fsdp", seed, n, replay),
    "hsdp": lambda seed, n, replay: sharded_runs("hsdp", seed, n, replay),
    "data": data_runs,
    "elastic": elastic_runs,
}
# Runs per suite: the full campaign has 40 + 8 + 8 + 4 + 2 = 62 faulted training runs.
FULL = {"ddp": 40, "fsdp": 8, "hsdp": 8, "data": 4, "elastic": 2}
QUICK = {"ddp": 4, "fsdp": 1, "hsdp": 1, "data": 1, "elastic": 0}


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
    args = ap.parse_args()
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
