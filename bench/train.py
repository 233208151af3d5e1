"""Training benchmark: raymesh.train vs plain torch DDP vs Ray Train TorchTrainer, in one run.

    python bench/train.py            # full: 200 steps, steady window steps 20..200 (~6-9 min)
    python bench/train.py --quick    # smoke run: 60 steps, steady window steps 20..60

One job for all three: MLP 784-1024-1024-10 (seed 0), SGD(lr=0.01), 2 ranks x batch 64 of
raymesh's SyntheticMNIST(4096) in raymesh's data order (so final losses must agree), CPU, gloo
on 127.0.0.1, torch.set_num_threads(1) per rank (raymesh: from cpus_per_worker=1). Order: an
untimed subprocess loads what every run loads (page cache); plain DDP; Ray Train cold, warm;
raymesh cold, warm; plain DDP again. Ray runs are subprocesses with their own Ray temp dir (never
joining another Ray on the machine) and a timeout; their process group is killed after.
- plain DDP: torch.multiprocessing spawns the ranks; t0 right before.
- Ray Train, TorchTrainer(ScalingConfig(num_workers=2, use_gpu=False)): cold = t0 right before
  a fresh python that imports Ray, ray.init(), fit(); warm = ray.init() first, t0 at fit().
- raymesh, train.fit("raymesh.examples.mlp:build_bench", TrainConfig(...)): cold = t0 before a
  fresh python whose fit() starts Ray; warm = ensure_ray() first, t0 at fit(); then each
  subprocess fits again with report_every=20 for the steady rate. "Warm" includes raymesh's warm
  procs being started (`pool.wait_ready()`), as a controller that has been up for a while has
  them.
First step: DDP and Ray Train ranks stamp time.time() after every step (the later rank's step 1
counts); raymesh's is the time fit()'s `progress` callback reports step 1 (report_every=1), about
1 ms after its ranks finish it. Steady steps/s = (steps - 20) / (t[steps] - t[20]): rank 0's
stamps; for raymesh the progress callbacks of its report_every=20 fit (two chunks stay in flight,
so ranks never wait for the controller). Each system: mean of its two runs. Progress goes to
stderr, one JSON object to stdout. `--child JSON` (internal) runs one subprocess measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _isolated import run_isolated

WORKERS, BATCH_PER_RANK, N_SAMPLES, SEED, FIRST = 2, 64, 4096, 0, 20
BUILD = "raymesh.examples.mlp:build_bench"
ANCHORS_PUBLISHED = {
    "source": "/work/shared/anchors (2-core 24 GiB CPU machine, 2026-11-29, medians)",
    "ray_train": {"cold_start_to_first_step_s": 28.1, "fit_to_first_step_s": 16.5},
    "ray_train_over_plain_ddp_steps_per_s": 0.95,
    "plain_ddp": {"launch_to_first_step_s": 3.1, "steps_per_s": 41.3},
}
FIRST_STEP_MAX, STEPS_PER_S_MIN = 0.6, 0.97  # raymesh vs Ray Train, raymesh vs plain DDP
METHODS = {
    "plain_ddp": "t0 right before torch.multiprocessing spawns the ranks; first step: the later "
    "rank's stamp after step 1; steady: rank 0's stamps; figures: mean of the 2 runs",
    "ray_train": "cold: t0 before a fresh python that imports Ray, ray.init(), fit(); warm: "
    "ray.init() first, t0 at trainer.fit(); rank stamps as for DDP; steady: mean of both runs",
    "raymesh": "first step: wall time of fit()'s progress callback for step 1 with "
    "report_every=1 (cold: t0 before a fresh python, fit() starts Ray; warm: ensure_ray() "
    "first, t0 at fit()); steady: progress callbacks of steps 20 and last of a second fit in "
    "each subprocess with report_every=20, mean of the two",
}
CHILD_ENV = {  # DDP ranks and subprocesses
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # Ray's node address: 127.0.0.1
    "GLOO_SOCKET_IFNAME": "lo",
}


def log(msg: str) -> None:
    print(f"[train-bench] {msg}", file=sys.stderr, flush=True)


def make_model() -> nn.Module:
    """raymesh's MLP784 layer for layer, seeded as raymesh seeds its build (seed 0)."""
    torch.manual_seed(SEED)
    h = 1024
    return nn.Sequential(nn.Linear(784, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, 10))


def run_steps(model: nn.Module, plan: torch.Tensor, rank: int, out: str) -> None:
    """The loop both baselines run: this rank's share of `plan` ([steps, global batch] sample
    indices) of SyntheticMNIST(4096, seed=0), drawn as raymesh draws it. Writes the wall time
    after each step and the losses to `out`.rank<rank>."""
    g = torch.Generator().manual_seed(SEED)
    x, y = torch.randn(N_SAMPLES, 784, generator=g), torch.randint(0, 10, (N_SAMPLES,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    stamps, losses = [], []
    for idx in plan[:, rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        stamps.append(time.time())
    Path(f"{out}.rank{rank}").write_text(json.dumps({"stamps": stamps, "losses": losses}))


def ddp_rank(rank: int, port: int, plan: torch.Tensor, out: str) -> None:
    """One plain-DDP rank (torch.multiprocessing entry point)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=WORKERS)
    run_steps(nn.parallel.DistributedDataParallel(make_model()), plan, rank, out)
    dist.barrier()
    dist.destroy_process_group()


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: the same loop as plain DDP."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    model = ray.train.torch.prepare_model(make_model())  # DDP over gloo on CPU
    rank = ray.train.get_context().get_world_rank()
    run_steps(model, torch.tensor(config["plan"]), rank, config["out"])


def summarise(out: str, t0: float, steps: int) -> dict[str, Any]:
    """First step (the later rank's), steady steps/s (rank 0) and final loss (rank mean)."""
    ranks = [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORKERS)]
    st = ranks[0]["stamps"]
    return {
        "launch_to_first_step_s": round(max(r["stamps"][0] for r in ranks) - t0, 3),
        "steps_per_s_steady": round((steps - FIRST) / (st[steps - 1] - st[FIRST - 1]), 2),
        "final_loss": round(sum(r["losses"][-1] for r in ranks) / WORKERS, 4),
    }


def run_plain_ddp(plan: torch.Tensor, td: str, tag: str, timeout: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(td, f"ddp_{tag}")
    t0 = time.time()
    ctx = mp.start_processes(ddp_rank, args=(port, plan, out), nprocs=WORKERS, join=False)
    while not ctx.join(timeout=1.0):
        if time.time() > t0 + timeout:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"plain DDP ({tag}) ran past {timeout:.0f} s")
    return {**summarise(out, t0, len(plan)), "loadavg_1m_after": round(os.getloadavg()[0], 2)}


def ray_train_child(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", logging_level="ERROR")  # cold: counted, from the process start
    plan = json.loads(Path(args.plan).read_text())
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"plan": plan, "out": args.out},
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(name="bench", storage_path=os.path.dirname(args.out)),
    )
    t_fit = time.time()
    t0 = t_fit if args.warm else args.t0
    trainer.fit()
    ray.shutdown()
    return {**summarise(args.out, t0, len(plan)), "launch_to_fit_call_s": round(t_fit - t0, 3)}


def raymesh_fit(steps: int, every: int, t0: float | None) -> dict[str, Any]:
    """One raymesh.train.fit of the bench job, timed by its progress callbacks."""
    from raymesh import train

    seen: dict[int, float] = {}
    cfg = train.TrainConfig(
        workers=WORKERS, steps=steps, global_batch_size=WORKERS * BATCH_PER_RANK,
        report_every=every, seed=SEED, cpus_per_worker=1.0,
    )  # fmt: skip
    t_fit = time.time()
    t0 = t_fit if t0 is None else t0
    result = train.fit(BUILD, cfg, progress=lambda p: seen.setdefault(p["step"], time.time()))
    run = {
        "report_every": every,
        "steps_per_s_steady": round((steps - FIRST) / (seen[steps] - seen[FIRST]), 2),
        "final_loss": round(result.history[-1]["loss"], 4),
        "strategy": result.decision.strategy,
    }
    if every == 1:
        run["launch_to_first_step_s"] = round(seen[1] - t0, 3)
        run["launch_to_fit_call_s"] = round(t_fit - t0, 3)
    return run


def raymesh_child(args: argparse.Namespace) -> dict[str, Any]:
    steps = len(json.loads(Path(args.plan).read_text()))
    if args.warm:  # Ray up, and its warm procs (raymesh's pool) started
        import raymesh.train  # noqa: F401  (first, as in a user's script: warm procs preload)
        from raymesh._src.backend import ensure_ray, pool

        ensure_ray()
        pool.wait_ready(300)
    first = raymesh_fit(steps, 1, None if args.warm else args.t0)
    return {"first": first, "steady": raymesh_fit(steps, 20, None)}


def prime_child(args: argparse.Namespace) -> dict[str, Any]:
    """Untimed: load what the measured runs load, so the page cache favours no system."""
    import ray
    import ray.train.torch

    import raymesh.train  # noqa: F401

    ray.init(address="local", logging_level="ERROR")
    ray.shutdown()
    return {}


def run_child(kind: str, warm: bool, plan_path: str, td: str, timeout: float) -> dict[str, Any]:
    """One measurement in a fresh python, in a session of its own (killed as a whole after)."""
    out = os.path.join(td, f"{kind}_{'warm' if warm else 'cold'}")
    spec = {"kind": kind, "warm": warm, "plan": plan_path, "out": out}
    # Our own Ray temp dir: ray.init() without an address joins the cluster named in
    # /tmp/ray/ray_current_cluster (any `ray start` on this machine, e.g. a test's).
    env = {**os.environ, "RAY_TMPDIR": td}
    t0 = time.time()
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps({**spec, "t0": t0})]
    rc = run_isolated(cmd, env, timeout)
    if rc != 0:
        why = f"ran past {timeout:.0f} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"{kind} ({'warm' if warm else 'cold'}) {why}")
    result: dict[str, Any] = json.loads(Path(out + ".json").read_text())
    wall, load = round(time.time() - t0, 2), round(os.getloadavg()[0], 2)
    return {**result, "wall_s": wall, "loadavg_1m_after": load}


def mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 3)


def report(ddp: list[dict], ray_train: dict[str, dict], mesh: dict[str, dict]) -> dict[str, Any]:
    """Per-system figures, ratios and targets from the runs."""
    mesh_runs = {f"{t}_{k}": mesh[t][k] for t in ("cold", "warm") for k in ("first", "steady")}
    first = {
        "plain_ddp": mean([d["launch_to_first_step_s"] for d in ddp]),
        "ray_train": {t: r["launch_to_first_step_s"] for t, r in ray_train.items()},
        "raymesh": {t: mesh[t]["first"]["launch_to_first_step_s"] for t in mesh},
    }
    steady = {"plain_ddp": ddp, "ray_train": list(ray_train.values())}
    steady["raymesh"] = [mesh[t]["steady"] for t in mesh]
    runs = {"plain_ddp": ddp, "ray_train": ray_train, "raymesh": mesh_runs}
    out: dict[str, Any] = {
        k: {
            "launch_to_first_step_s": first[k],
            "steps_per_s_steady": mean([r["steps_per_s_steady"] for r in steady[k]]),
            "final_loss": steady[k][-1]["final_loss"],
            "runs": runs[k],
            "method": METHODS[k],
        }
        for k in runs
    }
    sps = {k: out[k]["steps_per_s_steady"] for k in out}
    ratios = {f"raymesh_over_ray_train_first_step_{t}": round(
        first["raymesh"][t] / first["ray_train"][t], 3) for t in ("cold", "warm")}  # fmt: skip
    ratios["raymesh_over_plain_ddp_steps_per_s"] = round(sps["raymesh"] / sps["plain_ddp"], 3)
    ratios["ray_train_over_plain_ddp_steps_per_s"] = round(sps["ray_train"] / sps["plain_ddp"], 3)
    targets: dict[str, Any] = {"first_step_vs_ray_train_max": FIRST_STEP_MAX}
    targets["steps_per_s_vs_plain_ddp_min"] = STEPS_PER_S_MIN
    for t in ("cold", "warm"):
        ratio = ratios[f"raymesh_over_ray_train_first_step_{t}"]
        targets[f"first_step_{t}_met"] = ratio <= FIRST_STEP_MAX
    targets["steps_per_s_met"] = ratios["raymesh_over_plain_ddp_steps_per_s"] >= STEPS_PER_S_MIN
    losses = [r["final_loss"] for r in [*ddp, *ray_train.values(), *mesh_runs.values()]]
    out["final_losses_agree"] = max(losses) - min(losses) < 1e-3
    return {**out, "ratios": ratios, "targets": targets}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="60 steps, steady window 20..60")
    p.add_argument("--child", help=argparse.SUPPRESS)  # JSON: kind, warm, plan, out, t0
    args = p.parse_args()
    if args.child:
        c = argparse.Namespace(**json.loads(args.child))
        fn = {"ray_train": ray_train_child, "raymesh": raymesh_child, "prime": prime_child}
        Path(c.out + ".json").write_text(json.dumps(fn[c.kind](c)))
        return

    import ray

    import raymesh
    from raymesh.data import order as data

    steps, timeout = (60, 240.0) if args.quick else (200, 420.0)
    os.environ.update(CHILD_ENV)  # for the DDP ranks and every subprocess
    res: dict[str, Any] = {
        "bench": "train",
        "mode": "quick" if args.quick else "full",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "job": f"MLP 784-1024-1024-10, SGD(lr=0.01), {WORKERS} ranks x batch {BATCH_PER_RANK}, "
        f"{steps} steps (steady window {FIRST}..{steps}), CPU gloo 127.0.0.1, "
        "torch.set_num_threads(1) per rank, SyntheticMNIST(4096) in raymesh.data.order order",
        "versions": dict(python=platform.python_version(), torch=torch.__version__,
                         ray=ray.__version__, raymesh=raymesh.__version__, cpus=os.cpu_count()),
    }  # fmt: skip
    global_batch = WORKERS * BATCH_PER_RANK
    batches = [data.global_batch(SEED, s, global_batch, N_SAMPLES) for s in range(steps)]
    plan = torch.tensor(batches)
    with tempfile.TemporaryDirectory(prefix="bench_train_", ignore_cleanup_errors=True) as td:
        plan_path = os.path.join(td, "plan.json")
        Path(plan_path).write_text(json.dumps(batches))
        run_child("prime", False, plan_path, td, timeout)
        ddp = [run_plain_ddp(plan, td, "first", timeout)]
        log(f"plain DDP: {ddp[0]}")
        ray_train: dict[str, Any] = {}
        mesh: dict[str, Any] = {}
        for kind, into in (("ray_train", ray_train), ("raymesh", mesh)):
            for temp in ("cold", "warm"):
                into[temp] = run_child(kind, temp == "warm", plan_path, td, timeout)
                log(f"{kind} {temp}: {into[temp]}")
        ddp.append(run_plain_ddp(plan, td, "last", timeout))
        log(f"plain DDP (again): {ddp[1]}")
    res.update(report(ddp, ray_train, mesh))
    res["anchors_published"] = ANCHORS_PUBLISHED
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
