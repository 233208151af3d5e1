"""Tuning benchmark: raymesh.tune vs Ray Tune vs the same iterations back to back, in one run.

    python bench/tune.py                 # ~3 min on 2 cores

The job of ../shared/anchors/tune_asha.py: 16 trials of an MLP 20-64-64-10 on a fixed 10-class
set (2048 samples), one torch thread, SGD with learning rates log-spaced 1e-4 .. 1 (a grid);
an iteration is 40 SGD steps of batch 64, and each trial reports its loss after every one of
its 20 iterations. ASHA: grace 1 iteration, reduction factor 4, 4 trials at a time.
- back to back: every trial's 20 iterations, one after another in this process, no search;
- Ray Tune: Tuner(with_resources(cpu=0.5)) with ASHAScheduler, in a subprocess with its own
  ray.init(num_cpus=2) (it never joins raymesh's Ray);
- raymesh.tune: tune.run(sampler="grid", scheduler="asha", concurrent=4), each trial a
  one-rank train.fit of 800 steps reporting every 40 (cpus_per_worker=0.5), on raymesh's
  embedded Ray.
Both sides start their clock on a settled cluster: Ray Tune SETTLE_S after its ray.init (Ray
has prestarted its workers by then), raymesh once its warm procs are up (at most SETTLE_S
more than that). Each side's total is from the call that starts the study to its end; "first
report" from that call to the first reported iteration; "stopped early" the learning rates
whose trials ran fewer than 20 iterations (the two ASHA implementations, Ray Tune's and
Optuna's, see the reports in different orders, so the sets can differ).

Then healing inside a study: 4 trials (lr 0.01 .. 1) of a 2-rank DDP job each, without and with
rank 1 SIGKILLed at step 30 of every trial; the best trial and every trial's final loss should
be the same. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

TRIALS, ITERS, STEPS_PER_ITER, BATCH = 16, 20, 40, 64
TARGET_VS_BACK_TO_BACK, FIRST_REPORT_MAX_S = 2.0, 2.0
SETTLE_S = 10.0


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(10, 20, generator=g)
    y = torch.randint(0, 10, (2048,), generator=g)
    return centers[y] + torch.randn(2048, 20, generator=g), y


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(20, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 10),
    )


def back_to_back(lrs: list[float]) -> float:
    x, y = make_data()
    lossf = torch.nn.CrossEntropyLoss()
    t0 = time.perf_counter()
    for lr in lrs:
        m = model()
        opt = torch.optim.SGD(m.parameters(), lr=lr)
        for it in range(1, ITERS + 1):
            g = torch.Generator().manual_seed(it)
            for _ in range(STEPS_PER_ITER):
                idx = torch.randint(0, len(x), (BATCH,), generator=g)
                opt.zero_grad()
                lossf(m(x[idx]), y[idx]).backward()
                opt.step()
    return time.perf_counter() - t0


def build(ctx):
    from raymesh.train import Task

    m = model()
    return Task(
        model=m,
        optimizer=torch.optim.SGD(m.parameters(), lr=ctx.params["lr"]),
        dataset=torch.utils.data.TensorDataset(*make_data()),
        loss_fn=lambda mod, b: torch.nn.functional.cross_entropy(mod(b[0]), b[1]),
    )


def raymesh_tune(lrs: list[float]) -> dict:
    from raymesh import train, tune
    from raymesh._src import backend
    from raymesh._src.backend import pool

    backend.ensure_ray()
    pool.wait_ready(60.0)
    folder = tempfile.mkdtemp(prefix="bench_tune_")
    config = train.TrainConfig(
        workers=1,
        steps=ITERS * STEPS_PER_ITER,
        global_batch_size=BATCH,
        report_every=STEPS_PER_ITER,
        cpus_per_worker=0.5,
    )
    t0, wall0 = time.perf_counter(), time.time()
    study = tune.run(
        build,
        config,
        space={"lr": tune.choice(lrs)},
        trials=TRIALS,
        concurrent=4,
        sampler="grid",
        scheduler="asha",
        storage=os.path.join(folder, "study.db"),
    )
    total = time.perf_counter() - t0
    ends = []  # each trial's metrics.jsonl: the wall time of its first reported step
    for path in Path(folder, "trials").glob("*/metrics.jsonl"):
        with path.open() as f:
            ends.append(json.loads(f.readline())["end"])
    states = [t.state for t in study.trials]
    return {
        "total_s": round(total, 2),
        "first_report_s": round(min(ends) - wall0, 2) if ends else None,
        "trials": len(states),
        "complete": states.count("complete"),
        "pruned": states.count("pruned"),
        "failed": states.count("failed"),
        "best_lr": study.best.params["lr"],
        "iterations_run": sum(len(t.curve) for t in study.trials),
        "stopped_early": sorted(t.params["lr"] for t in study.trials if len(t.curve) < ITERS),
    }


def ddp_study(kill_at: int | None) -> dict:
    """4 trials of a 2-rank DDP job (loss after 100 steps), with rank 1 of every trial
    SIGKILLed at step `kill_at` (None: no kill)."""
    from raymesh import testing, train, tune

    faults = [testing.kill(rank=1, at_step=kill_at)] if kill_at else []
    config = train.TrainConfig(
        workers=2,
        steps=100,
        global_batch_size=BATCH,
        report_every=20,
        cpus_per_worker=0.5,
        faults=faults,
    )
    t0 = time.perf_counter()
    study = tune.run(
        build,
        config,
        space={"lr": tune.choice([0.01, 0.1, 0.3, 1.0])},
        trials=4,
        concurrent=2,
        sampler="grid",
        scheduler=None,
    )
    return {
        "total_s": round(time.perf_counter() - t0, 2),
        "best_lr": study.best.params["lr"],
        "losses": {str(t.params["lr"]): t.value for t in study.trials},
        "states": [t.state for t in study.trials],
    }


RAY_TUNE = """
import json, sys, time
import numpy as np, torch, ray
from ray import tune
from ray.tune.schedulers import ASHAScheduler
ITERS, STEPS_PER_ITER, BATCH = {iters}, {steps}, {batch}
{shared}

def trainable(config):
    torch.set_num_threads(1)
    x, y = make_data()
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=config["lr"])
    lossf = torch.nn.CrossEntropyLoss()
    for it in range(1, ITERS + 1):
        g = torch.Generator().manual_seed(it)
        for _ in range(STEPS_PER_ITER):
            idx = torch.randint(0, len(x), (BATCH,), generator=g)
            opt.zero_grad()
            loss = lossf(m(x[idx]), y[idx])
            loss.backward()
            opt.step()
        tune.report({{"loss": float(loss), "t_wall": time.time()}})

ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
time.sleep({settle})
lrs = {lrs!r}
t0 = time.time()
tuner = tune.Tuner(
    tune.with_resources(trainable, {{"cpu": 0.5}}),
    param_space={{"lr": tune.grid_search(lrs)}},
    tune_config=tune.TuneConfig(
        scheduler=ASHAScheduler(metric="loss", mode="min", max_t=ITERS, grace_period=1,
                                reduction_factor=4),
        num_samples=1, max_concurrent_trials=4),
)
results = tuner.fit()
total = time.time() - t0
df = results.get_dataframe()
first = min(r.metrics_dataframe["t_wall"].min() for r in results) - t0
iters = sum(len(r.metrics_dataframe) for r in results)
stopped = sorted(r.config["lr"] for r in results if len(r.metrics_dataframe) < ITERS)
print(json.dumps({{"total_s": round(total, 2), "first_report_s": round(first, 2),
                  "iterations_run": int(iters), "trials": len(df), "stopped_early": stopped}}))
"""


def ray_tune(lrs: list[float]) -> dict:
    shared = inspect.getsource(make_data) + "\n" + inspect.getsource(model)
    code = RAY_TUNE.format(
        shared=shared, lrs=lrs, iters=ITERS, steps=STEPS_PER_ITER, batch=BATCH, settle=SETTLE_S
    )
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0", RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env
    )
    if out.returncode != 0:
        return {"error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json-out", default=None)
    ap.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    lrs = [float(v) for v in np.logspace(-4, 0, TRIALS)]
    b2b = back_to_back(lrs)
    log(f"back to back: {b2b:.2f} s")
    rt = ray_tune(lrs)
    log(f"ray tune: {rt}")
    rm = raymesh_tune(lrs)
    log(f"raymesh.tune: {rm}")
    clean, healed = ddp_study(None), ddp_study(30)
    log(f"ddp study: {clean}; with a kill in every trial: {healed}")
    both = set(rm["stopped_early"]) | set(rt.get("stopped_early", []))
    same = set(rm["stopped_early"]) & set(rt.get("stopped_early", []))
    out = {
        "bench": "tune",
        "loadavg_start": [round(x, 2) for x in load_start],
        "cpus": os.cpu_count(),
        "job": f"{TRIALS} trials x {ITERS} iterations of {STEPS_PER_ITER} SGD steps, ASHA",
        "back_to_back_s": round(b2b, 2),
        "ray_tune": rt,
        "raymesh_tune": rm,
        "ratios_vs_back_to_back": {
            "ray_tune": round(rt.get("total_s", float("nan")) / b2b, 2),
            "raymesh_tune": round(rm["total_s"] / b2b, 2),
        },
        "target_vs_back_to_back_max": TARGET_VS_BACK_TO_BACK,
        "first_report_max_s": FIRST_REPORT_MAX_S,
        "stopped_early_in_both": sorted(same),
        "stopped_early_by_one_only": sorted(both - same),
        "ddp_study": {
            "clean": clean,
            "sigkill_in_every_trial": healed,
            "same_best": clean["best_lr"] == healed["best_lr"],
            "same_losses": clean["losses"] == healed["losses"],
        },
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
    }
    text = json.dumps(out)
    print(text)
    if out_path := ap.parse_args().json_out:
        with open(out_path, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
