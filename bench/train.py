"""Training benchmark: raymesh.train vs plain torch DDP vs Ray Train TorchTrainer, in one run.

Run (from the repository root; Ray Train comes with the `bench` extra):
    python bench/train.py            # full: 200 steps, steady window steps 20..200
    python bench/train.py --quick    # smoke run: 60 steps, steady window steps 20..60

The same job for all three: MLP 784-1024-1024-10 (torch.manual_seed(0) init), SGD(lr=0.01),
2 ranks of batch 64 (global 128) on raymesh's SyntheticMNIST(4096) in raymesh's data order, so
the three loss curves should agree; CPU, gloo on 127.0.0.1, torch.set_num_threads(1) per rank.
  plain DDP: torch.multiprocessing spawns 2 ranks from this process; t0 right before spawning.
  Ray Train: TorchTrainer(ScalingConfig(num_workers=2, use_gpu=False)), each in a subprocess:
    cold = t0 in this process right before starting a fresh python (Ray not running), which
    calls ray.init() and fit(); warm = a fresh python calls ray.init() first, t0 at fit().
  raymesh: train.fit("raymesh.examples.mlp:build_bench", ...), cold and warm alike (warm calls
    raymesh._src.backend.ensure_ray() first).
First step: DDP and Ray Train ranks stamp time.time() after each step (first step = the later
rank's step 1); raymesh cannot be stamped inside its ranks, so its first step is the wall time at
which the controller's `progress` callback reports step 1 (report_every=1; ~1 ms later than the
ranks finish it, a cost counted against raymesh). Steady steps/s = (hi - 20) / (t[hi] - t[20]):
rank 0's stamps for DDP and Ray Train; for raymesh the progress-callback times of steps 20 and
hi in a run with report_every=20 (two chunks stay in flight, so the ranks never wait on them).
Internal: `--child KIND` runs one subprocess measurement. Prints progress to stderr and exactly
one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WORKERS, BATCH_PER_RANK, N_SAMPLES, SEED, FIRST = 2, 64, 4096, 0, 20
BUILD = "raymesh.examples.mlp:build_bench"
ANCHORS_PUBLISHED = {
    "source": "/work/shared/anchors (2-core 24 GiB CPU machine, 2026-11-29, medians)",
    "ray_train": {"cold_start_to_first_step_s": 28.1, "fit_to_first_step_s": 16.5},
    "ray_train_over_plain_ddp_steps_per_s": 0.95,
    "plain_ddp": {"launch_to_first_step_s": 3.1, "steps_per_s": 41.3},
}
TARGETS = {"first_step_vs_ray_train_max": 0.6, "steps_per_s_vs_plain_ddp_min": 0.97}
CHILD_ENV = {
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


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """The samples of raymesh's SyntheticMNIST(n=4096, seed=0), drawn the same way."""
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(N_SAMPLES, 784, generator=g), torch.randint(0, 10, (N_SAMPLES,), generator=g)


def run_steps(model: nn.Module, plan: torch.Tensor, rank: int) -> dict[str, Any]:
    """Train one rank through `plan` ([steps, global batch] of sample indices); the loop both
    baselines share. Returns wall stamps after each step and the losses."""
    x, y = make_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    share = plan[:, rank * BATCH_PER_RANK : (rank + 1) * BATCH_PER_RANK]
    stamps, losses = [], []
    for idx in share:
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        stamps.append(time.time())
    return {"rank": rank, "stamps": stamps, "losses": losses}


def ddp_rank(rank: int, port: int, plan: torch.Tensor, out: str) -> None:
    """One plain-DDP rank (torch.multiprocessing entry point)."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    url = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=url, rank=rank, world_size=WORKERS)
    res = run_steps(nn.parallel.DistributedDataParallel(make_model()), plan, rank)
    Path(f"{out}.rank{rank}").write_text(json.dumps(res))
    dist.barrier()
    dist.destroy_process_group()


def ray_train_loop(config: dict[str, Any]) -> None:
    """Ray Train's train_loop_per_worker: the same loop as plain DDP."""
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    rank = ray.train.get_context().get_world_rank()
    model = ray.train.torch.prepare_model(make_model())  # DDP over gloo on CPU
    res = run_steps(model, torch.tensor(config["plan"]), rank)
    Path(f"{config['out']}.rank{rank}").write_text(json.dumps(res))


def summarise(ranks: list[dict[str, Any]], t0: float, hi: int) -> dict[str, Any]:
    r0 = min(ranks, key=lambda r: r["rank"])
    st = r0["stamps"]
    return {
        "launch_to_first_step_s": round(max(r["stamps"][0] for r in ranks) - t0, 3),
        "steps_per_s_steady": round((hi - FIRST) / (st[hi - 1] - st[FIRST - 1]), 2),
        "final_loss": round(sum(r["losses"][-1] for r in ranks) / len(ranks), 4),
    }


def read_ranks(out: str) -> list[dict[str, Any]]:
    return [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(WORKERS)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_plain_ddp(plan: torch.Tensor, td: str, tag: str, timeout: float) -> dict[str, Any]:
    import torch.multiprocessing as mp

    out = os.path.join(td, f"ddp_{tag}")
    t0 = time.time()
    ctx = mp.start_processes(
        ddp_rank, args=(free_port(), plan, out), nprocs=WORKERS, join=False, start_method="spawn"
    )
    deadline = t0 + timeout
    while not ctx.join(timeout=1.0):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"plain DDP ({tag}) ran past {timeout:.0f} s")
    res = summarise(read_ranks(out), t0, len(plan))
    return {**res, "loadavg_1m_after": round(os.getloadavg()[0], 2)}


def ray_train_child(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(logging_level="ERROR")  # cold: counted too, from the process start (args.t0)
    plan = json.loads(Path(args.plan).read_text())
    trainer = TorchTrainer(
        ray_train_loop,
        train_loop_config={"plan": plan, "out": args.out},
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(name="bench", storage_path=os.path.dirname(args.out)),
    )
    t0 = time.time() if args.warm else args.t0
    trainer.fit()
    res = summarise(read_ranks(args.out), t0, len(plan))
    ray.shutdown()
    return res


def raymesh_fit(steps: int, every: int, t0: float | None) -> dict[str, Any]:
    """One raymesh.train.fit of the bench job; wall times of its progress callbacks."""
    from raymesh import train

    seen: dict[int, float] = {}
    cfg = train.TrainConfig(
        workers=WORKERS, steps=steps, global_batch_size=WORKERS * BATCH_PER_RANK,
        report_every=every, seed=SEED, strategy="auto", cpus_per_worker=1.0,
    )  # fmt: skip
    t0 = time.time() if t0 is None else t0
    result = train.fit(BUILD, cfg, progress=lambda p: seen.setdefault(p["step"], time.time()))
    run = {
        "report_every": every,
        "steps_per_s_steady": round((steps - FIRST) / (seen[steps] - seen[FIRST]), 2),
        "final_loss": round(result.history[-1]["loss"], 4),
        "strategy": result.decision.strategy,
    }
    if every == 1:
        run["launch_to_first_step_s"] = round(seen[1] - t0, 3)
    return run


def raymesh_child(args: argparse.Namespace) -> dict[str, Any]:
    steps = len(json.loads(Path(args.plan).read_text()))
    if args.warm:
        from raymesh._src.backend import ensure_ray

        ensure_ray()  # warm: Ray up first, t0 at fit(); cold: t0 = process start, fit starts Ray
    first = raymesh_fit(steps, 1, None if args.warm else args.t0)
    return {"first": first, "steady": raymesh_fit(steps, 20, None)}


def prime_child(args: argparse.Namespace) -> dict[str, Any]:
    """Untimed: read every file the measured runs load into the page cache, so that no
    system's cold start pays for disk reads another system's run made before it."""
    import ray
    import ray.train.torch
    import torch.distributed  # noqa: F401

    import raymesh.train  # noqa: F401

    ray.init(logging_level="ERROR")
    ray.shutdown()
    return {}


def run_child(kind: str, warm: bool, plan_path: str, td: str, timeout: float) -> dict[str, Any]:
    """One measurement in a fresh python (own session, so every leftover can be killed)."""
    out = os.path.join(td, f"{kind}_{'warm' if warm else 'cold'}")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--plan", plan_path]
    cmd += ["--out", out, *(["--warm"] if warm else [])]
    env = {**os.environ, **CHILD_ENV}
    t0 = time.time()
    proc = subprocess.Popen(
        [*cmd, "--t0", repr(t0)], stdout=sys.stderr, env=env, start_new_session=True
    )
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the child's Ray and any other leftovers
        except ProcessLookupError:
            pass
    if rc != 0:
        why = f"ran past {timeout:.0f} s" if rc is None else f"exited with {rc}"
        raise RuntimeError(f"{kind} ({'warm' if warm else 'cold'}) {why}")
    result: dict[str, Any] = json.loads(Path(out + ".json").read_text())
    result["wall_s"] = round(time.time() - t0, 2)
    result["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    return result


def mean(xs: list[float]) -> float:
    return round(sum(xs) / len(xs), 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="60 steps, steady window 20..60")
    p.add_argument("--child", choices=["ray_train", "raymesh", "prime"], help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        fn = {"ray_train": ray_train_child, "raymesh": raymesh_child, "prime": prime_child}
        Path(args.out + ".json").write_text(json.dumps(fn[args.child](args)))
        return

    import ray

    import raymesh
    from raymesh.train import data

    steps, timeout = (60, 240.0) if args.quick else (200, 420.0)
    job = dict(
        model="MLP 784-1024-1024-10 (1,863,690 params)", optimizer="SGD(lr=0.01)",
        workers=WORKERS, batch_per_rank=BATCH_PER_RANK, steps=steps, steady_window=[FIRST, steps],
        torch_threads_per_rank=1, backend="CPU, gloo, 127.0.0.1",
        data=f"SyntheticMNIST({N_SAMPLES}, seed={SEED}) in raymesh.train.data order",
    )  # fmt: skip
    versions = dict(
        python=platform.python_version(), torch=torch.__version__, ray=ray.__version__,
        raymesh=raymesh.__version__, cpus=os.cpu_count(),
    )  # fmt: skip
    res: dict[str, Any] = {"bench": "train", "mode": "quick" if args.quick else "full"}
    res.update(loadavg_start=[round(x, 2) for x in os.getloadavg()], job=job, versions=versions)
    global_batch = WORKERS * BATCH_PER_RANK
    plan = torch.tensor([data.global_batch(SEED, s, global_batch, N_SAMPLES) for s in range(steps)])
    with tempfile.TemporaryDirectory(prefix="bench_train_") as td:
        plan_path = os.path.join(td, "plan.json")
        Path(plan_path).write_text(json.dumps(plan.tolist()))
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

    ddp_sps = mean([d["steps_per_s_steady"] for d in ddp])
    res["plain_ddp"] = {
        "launch_to_first_step_s": mean([d["launch_to_first_step_s"] for d in ddp]),
        "steps_per_s_steady": ddp_sps,
        "final_loss": ddp[0]["final_loss"],
        "runs": ddp,
        "method": "mean of 2 runs (first and last in this benchmark); t0 right before "
        "torch.multiprocessing spawns; first step = later rank's stamp after step 1",
    }
    rt_sps = mean([r["steps_per_s_steady"] for r in ray_train.values()])
    res["ray_train"] = {
        **ray_train,
        "steps_per_s_steady": rt_sps,
        "method": "cold: t0 before the subprocess starts (it imports ray, ray.init(), fit()); "
        "warm: subprocess runs ray.init(), t0 at trainer.fit(); stamps from the ranks; steady "
        "= mean of the cold and warm runs",
    }
    cold, warm = mesh["cold"]["first"], mesh["warm"]["first"]
    mesh_sps = mean([mesh[t]["steady"]["steps_per_s_steady"] for t in ("cold", "warm")])
    res["raymesh"] = {
        **mesh,
        "steps_per_s_steady": mesh_sps,
        "final_loss": mesh["warm"]["steady"]["final_loss"],
        "method": "each subprocess fits twice: 'first' with report_every=1, whose progress "
        "callback of step 1 gives the first step (cold: t0 before the subprocess starts, fit() "
        "starts Ray; warm: ensure_ray() first, t0 at fit()); then 'steady' with report_every=20, "
        "steps/s from its progress callbacks of steps 20 and last; steady = mean of the two",
    }
    ratios = {
        "raymesh_over_ray_train_first_step_cold": round(
            cold["launch_to_first_step_s"] / ray_train["cold"]["launch_to_first_step_s"], 3
        ),
        "raymesh_over_ray_train_first_step_warm": round(
            warm["launch_to_first_step_s"] / ray_train["warm"]["launch_to_first_step_s"], 3
        ),
        "raymesh_over_plain_ddp_steps_per_s": round(mesh_sps / ddp_sps, 3),
        "ray_train_over_plain_ddp_steps_per_s": round(rt_sps / ddp_sps, 3),
    }
    res["ratios"] = ratios
    lim, floor = TARGETS["first_step_vs_ray_train_max"], TARGETS["steps_per_s_vs_plain_ddp_min"]
    res["targets"] = {
        **TARGETS,
        "first_step_cold_met": ratios["raymesh_over_ray_train_first_step_cold"] <= lim,
        "first_step_warm_met": ratios["raymesh_over_ray_train_first_step_warm"] <= lim,
        "steps_per_s_met": ratios["raymesh_over_plain_ddp_steps_per_s"] >= floor,
    }
    res["anchors_published"] = ANCHORS_PUBLISHED
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
