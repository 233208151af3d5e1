"""Data benchmark: a trainer fed by raymesh.data vs torch's DataLoader vs Ray Data, in one run.

    python bench/data.py                      # 150 and 1000 steps, 2 rounds (~12 min, 2 cores)
    python bench/data.py --steps 150 --repeats 1

The job of ../shared/anchors/data_util.py: an MLP 256-1024-1024-10 trained with SGD in this
process, one intra-op thread, batch 128. Sample i is made from i alone: a 4096-point noisy
signal, a random circular shift, |rfft| repeated `reps` times, the first 256 bins, log1p; `reps`
is calibrated at start-up as the anchor does (preprocessing a batch costs a few training steps).
Variants, each over the same number of steps:
  dataloader_0   torch DataLoader(num_workers=0): preprocessing in the trainer
  dataloader_1   DataLoader(num_workers=1, prefetch_factor=2)
  ray_data       ray.data.range(N).map_batches(...).iter_torch_batches(prefetch_batches=4),
                 Ray Data limited to 2 CPUs (the machine's cores, as the anchor's ray.init(2))
  raymesh_1      data.batches(Pipeline(workers=1, prefetch=8)): one preprocessing proc
  raymesh_1_2    the same with workers=(1, 2): it scales from the trainer's measured wait
Whole-run steps/s counts from the call that starts iterating to the last step, so start-up
is included (for raymesh: starting its preprocessing procs; batches are made in the trainer
until the first is up); first_batch_s is the time to the first batch; busy is the trainer's
forward/backward/step time over the whole run. Ray (raymesh's embedded local Ray) is started
once before any variant, outside the timings, as the anchor does. Each round runs every variant
once, in the order above (rounds interleave, so a machine that slows down slows all of them);
figures are medians over rounds. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

SIG, FEAT, CLASSES = 4096, 256, 10
TARGET_VS_DATALOADER_0 = 1.35  # the target for whole-run steps/s at 1,000 steps
FIRST_BATCH_MAX_S = 1.0


def log(*a: object) -> None:
    print(*a, file=sys.stderr, flush=True)


def prep_one(i: int, reps: int) -> tuple[np.ndarray, int]:
    rng = np.random.default_rng(int(i))
    t = np.arange(SIG, dtype=np.float32)
    sig = np.sin(t * (0.01 * (1 + i % CLASSES))) + rng.normal(0, 0.5, SIG).astype(np.float32)
    sig = np.roll(sig, int(rng.integers(0, SIG)))
    for _ in range(reps):
        spec = np.abs(np.fft.rfft(sig))
    return np.log1p(spec[:FEAT]).astype(np.float32), int(i % CLASSES)


class Signals(torch.utils.data.Dataset):
    def __init__(self, n: int, reps: int) -> None:
        self.n, self.reps = n, reps

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = prep_one(i, self.reps)
        return torch.from_numpy(x), y


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.nn.Module]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Linear(FEAT, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, CLASSES),
    )
    return m, torch.optim.SGD(m.parameters(), lr=0.01), torch.nn.CrossEntropyLoss()


def train_loop(make_batches, steps: int) -> dict[str, float]:
    """Time from the call that creates the batch iterator to the last step."""
    m, opt, lossf = build()
    t_call = time.perf_counter()
    batches = make_batches()
    busy, n, first = 0.0, 0, None
    for x, y in batches:
        if first is None:
            first = time.perf_counter() - t_call
        t0 = time.perf_counter()
        opt.zero_grad()
        lossf(m(x), y).backward()
        opt.step()
        busy += time.perf_counter() - t0
        n += 1
        if n >= steps:
            break
    wall = time.perf_counter() - t_call
    close = getattr(batches, "close", None)
    if close is not None:
        close()
    return {
        "steps_per_s": round(n / wall, 2),
        "first_batch_s": round(first or 0.0, 3),
        "busy": round(busy / wall, 3),
        "wall_s": round(wall, 2),
    }


def calibrate(batch: int) -> tuple[float, int, float]:
    """The anchor's calibration: reps so that preprocessing a batch costs about a step."""
    m, opt, lossf = build()
    x, y = torch.randn(batch, FEAT), torch.randint(0, CLASSES, (batch,))
    ts = []
    for _ in range(30):
        t0 = time.perf_counter()
        opt.zero_grad()
        lossf(m(x), y).backward()
        opt.step()
        ts.append(time.perf_counter() - t0)
    step = statistics.median(ts[5:])

    def prep(reps: int) -> float:
        times = []
        for k in range(5):
            t0 = time.perf_counter()
            for i in range(k * batch, (k + 1) * batch):
                prep_one(i, reps)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    p1, p3 = prep(1), prep(3)
    per_rep = max((p3 - p1) / 2, 1e-6)
    reps = max(1, round((step - max(p1 - per_rep, 0.0)) / per_rep))
    return step, reps, prep(reps)


def dataloader(steps: int, batch: int, reps: int, workers: int):
    extra = {"prefetch_factor": 2} if workers else {}
    return lambda: iter(
        torch.utils.data.DataLoader(
            Signals(steps * batch, reps), batch_size=batch, num_workers=workers, **extra
        )
    )


def ray_data(steps: int, batch: int, reps: int):
    import ray
    from ray.data import DataContext, ExecutionResources

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.execution_options.resource_limits = ExecutionResources.for_limits(cpu=2)

    def fn(b):
        xs, ys = zip(*(prep_one(i, reps) for i in b["id"]))
        return {"x": np.stack(xs), "y": np.asarray(ys, dtype=np.int64)}

    def make():
        ds = ray.data.range(steps * batch).map_batches(fn, batch_size=batch, batch_format="numpy")
        it = ds.iter_torch_batches(batch_size=batch, prefetch_batches=4)
        return ((b["x"], b["y"]) for b in it)

    return make


def raymesh_data(steps: int, batch: int, reps: int, workers: int | tuple[int, int]):
    from raymesh import data

    pipe = data.Pipeline(source=Signals(steps * batch, reps), workers=workers, prefetch=8)
    return lambda: iter(data.batches(pipe, batch_size=batch, steps=steps))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, nargs="+", default=[150, 1000])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_start = os.getloadavg()
    step, reps, prep = calibrate(args.batch)
    log(f"calibrated: step {step * 1e3:.1f} ms, prep batch {prep * 1e3:.1f} ms (reps={reps})")

    from raymesh._src import backend

    t0 = time.perf_counter()
    backend.ensure_ray()
    ray_start_s = time.perf_counter() - t0
    out: dict = {
        "bench": "data",
        "loadavg_start": [round(x, 2) for x in load_start],
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        },
        "batch": args.batch,
        "train_step_ms": round(step * 1e3, 2),
        "prep_batch_ms": round(prep * 1e3, 2),
        "prep_over_step": round(prep / step, 2),
        "fft_reps": reps,
        "ray_start_s": round(ray_start_s, 2),
        "runs": {},
    }
    for steps in args.steps:
        variants = {
            "dataloader_0": dataloader(steps, args.batch, reps, 0),
            "dataloader_1": dataloader(steps, args.batch, reps, 1),
            "ray_data": ray_data(steps, args.batch, reps),
            "raymesh_1": raymesh_data(steps, args.batch, reps, 1),
            "raymesh_1_2": raymesh_data(steps, args.batch, reps, (1, 2)),
        }
        rounds: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        for k in range(args.repeats):
            for name, make in variants.items():
                rounds[name].append(r := train_loop(make, steps))
                log(f"{steps} steps, round {k}: {name:14s} {r}")
        results = {
            name: {m: round(statistics.median(r[m] for r in rs), 3) for m in rs[0]} | {"rounds": rs}
            for name, rs in rounds.items()
        }
        base = results["dataloader_0"]["steps_per_s"]
        best_raymesh = max(
            results["raymesh_1"]["steps_per_s"], results["raymesh_1_2"]["steps_per_s"]
        )
        best_other = max(
            r["steps_per_s"] for k, r in results.items() if not k.startswith("raymesh")
        )
        out["runs"][str(steps)] = {
            **results,
            "speedup_vs_dataloader_0": {
                k: round(r["steps_per_s"] / base, 2) for k, r in results.items()
            },
            "raymesh_above_every_other": best_raymesh > best_other,
        }
    long = out["runs"][str(max(args.steps))]
    out["targets"] = {
        "steps_per_s_vs_dataloader_0_min": TARGET_VS_DATALOADER_0,
        "met_speedup": max(
            long["speedup_vs_dataloader_0"]["raymesh_1"],
            long["speedup_vs_dataloader_0"]["raymesh_1_2"],
        )
        >= TARGET_VS_DATALOADER_0,
        "met_above_every_other": long["raymesh_above_every_other"],
        "first_batch_max_s": FIRST_BATCH_MAX_S,
        "met_first_batch": all(
            run[k]["first_batch_s"] <= FIRST_BATCH_MAX_S
            for run in out["runs"].values()
            for k in ("raymesh_1", "raymesh_1_2")
        ),
    }
    out["anchors_published"] = {
        "source": "/work/shared/anchors/data_util.py (2-core CPU machine, 200 steps, from the "
        "first batch, start-up excluded)",
        "steps_per_s": {"dataloader_0": 22.5, "dataloader_1": 26.2, "ray_data": 46.3},
        "ray_data_first_batch_s": 3.65,
    }
    out["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(out)
    print(text)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
