"""Recovery benchmark: one SIGKILL at step 100, raymesh (with and without a warm spare) vs Ray
Train (FailureConfig) vs torchrun --max-restarts, in one run.

    python bench/recovery.py            # ~4-6 min on 2 cores
    python bench/recovery.py --quick    # 60 steps, kill at 40, checkpoints every 10

The job for all four: MLP 784-1024-1024-10, SGD(lr=0.01), 2 ranks x batch 64, CPU gloo on
127.0.0.1, one torch thread per rank, 200 steps; rank 1 is SIGKILLed once, at step 100. Every
system checkpoints every 20 steps (the anchors need it to recover; raymesh writes them too, so
the steady cost is the same, though it heals from a peer's memory instead).

What is measured, per system:
- kill_to_first_step_s: from the SIGKILL to the end of the first step completed after recovery.
  Ray Train and torchrun: the killed rank writes the time to a marker file, then kills itself
  right after step 100's optimizer step, before that step's checkpoint (so the newest checkpoint
  is step 80); the first step after recovery is the first one the restarted group completes.
  raymesh: the kill fires as rank 1 starts step 100, right after step 99 ended, so the kill time
  is step 99's end (`Result.history[i]["end"]`) and the first step after recovery is step 100.
- steps_recomputed: steps trained twice. Anchors: steps completed before the kill and done again
  after the restart. raymesh: `FailureRecord.steps_recomputed`, which also counts the step in
  flight that no rank completed (so 1 is "only the step in flight").
Each system runs in a fresh subprocess (its own Ray temp dir) with a timeout. Progress goes to
stderr, one JSON object to stdout. `--child JSON` (internal) runs one measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
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

BATCH_PER_RANK, WORKERS = 64, 2
RAY_TRAIN_PUBLISHED = {"kill_to_first_step_s": 13.4, "steps_recomputed": 40}
TARGET_VS_RAY_TRAIN, TARGET_SPARE_S, TARGET_RECOMPUTED = 0.25, 1.0, 1
CHILD_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "GLOO_SOCKET_IFNAME": "lo",
}


def log(msg: str) -> None:
    print(f"[recovery-bench] {msg}", file=sys.stderr, flush=True)


# ---- the anchors' loop (Ray Train and torchrun run the same function) -------------------------
def anchor_loop(
    rank: int, spec: dict[str, Any], model: nn.Module, opt: Any, start: int, save: Any
) -> None:
    """Train steps start+1..spec["steps"]; rank `spec["kill_rank"]` SIGKILLs itself once at
    spec["kill_step"]. Appends {"step", "t", "pid"} per step to a per-rank log."""
    g = torch.Generator().manual_seed(1234 + rank)
    xs = torch.randn(8, BATCH_PER_RANK, 784, generator=g)
    ys = torch.randint(0, 10, (8, BATCH_PER_RANK), generator=g)
    with open(f"{spec['log']}.r{rank}", "a", buffering=1) as out:
        out.write(json.dumps({"enter": time.time(), "pid": os.getpid(), "from": start}) + "\n")
        for step in range(start + 1, spec["steps"] + 1):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(xs[step % 8]), ys[step % 8]).backward()
            opt.step()
            out.write(json.dumps({"step": step, "t": time.time(), "pid": os.getpid()}) + "\n")
            killing = step == spec["kill_step"] and rank == spec["kill_rank"]
            if killing and not os.path.exists(spec["marker"]):
                Path(spec["marker"]).write_text(json.dumps({"t": time.time(), "step": step}))
                os.kill(os.getpid(), signal.SIGKILL)
            if step % spec["every"] == 0:
                save(step)


def restored_model(state: dict[str, Any] | None) -> tuple[nn.Module, Any, int]:
    """The bench model and its SGD, from a checkpoint's state when there is one (loaded before
    DDP wraps the model, as both anchors do)."""
    from raymesh.examples.mlp import MLP784

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP784()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if state is None:
        return model, opt, 0
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    return model, opt, int(state["step"])


def analyse_anchor(spec: dict[str, Any]) -> dict[str, Any]:
    """Kill to the first step the restarted group completed, and the steps done twice."""
    kill = json.loads(Path(spec["marker"]).read_text())
    rows = [json.loads(x) for x in Path(f"{spec['log']}.r0").read_text().splitlines()]
    pids = list(dict.fromkeys(r["pid"] for r in rows))
    steps = [r for r in rows if "step" in r]
    before = {r["step"] for r in steps if r["pid"] == pids[0]}
    after = [r for r in steps if r["pid"] != pids[0]]
    return {
        "kill_to_first_step_s": round(after[0]["t"] - kill["t"], 3),
        "steps_recomputed": len(before & {r["step"] for r in after}),
        "resumed_from": [r["from"] for r in rows if "enter" in r][-1],
        "restarts": len(pids) - 1,
        "final_step": steps[-1]["step"],
    }


def ray_train_child(spec: dict[str, Any]) -> dict[str, Any]:
    import ray
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address="local", logging_level="ERROR")
    trainer = TorchTrainer(
        _ray_train_loop,
        train_loop_config=spec,
        scaling_config=ScalingConfig(num_workers=WORKERS, use_gpu=False),
        run_config=RunConfig(
            name="recovery",
            storage_path=os.path.join(spec["dir"], "ray_storage"),
            failure_config=FailureConfig(max_failures=2),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    ray.shutdown()
    return {**analyse_anchor(spec), "error": repr(result.error) if result.error else None}


def _ray_train_loop(spec: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    from ray.train import Checkpoint

    rank = ray.train.get_context().get_world_rank()
    state = None
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=True)
    model, opt, start = restored_model(state)
    wrapped = ray.train.torch.prepare_model(model)

    def save(step: int) -> None:
        with tempfile.TemporaryDirectory() as d:
            checkpoint = None
            if rank == 0:
                saved = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
                torch.save(saved, os.path.join(d, "state.pt"))
                checkpoint = Checkpoint.from_directory(d)
            ray.train.report({"step": step}, checkpoint=checkpoint)

    anchor_loop(rank, spec, wrapped, opt, start, save)


def torchrun_child(spec: dict[str, Any]) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={WORKERS}", "--max-restarts=2", "--monitor-interval=0.1",
        os.path.abspath(__file__), "--torchrun-rank", json.dumps(spec),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=sys.stderr, timeout=600)
    return analyse_anchor(spec)


def torchrun_rank(spec: dict[str, Any]) -> None:
    """One rank under torchrun: checkpoints are rank 0's torch.save, written atomically."""
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    path = os.path.join(spec["dir"], "torchrun_ckpt.pt")
    state = torch.load(path, weights_only=True) if os.path.exists(path) else None
    model, opt, start = restored_model(state)

    def save(step: int) -> None:
        dist.barrier()  # every rank finished the step (as Ray Train's report), then rank 0 saves
        if rank == 0:
            saved = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            torch.save(saved, path + ".tmp")
            os.replace(path + ".tmp", path)

    anchor_loop(rank, spec, nn.parallel.DistributedDataParallel(model), opt, start, save)
    dist.destroy_process_group()


def raymesh_child(spec: dict[str, Any]) -> dict[str, Any]:
    from raymesh import train
    from raymesh.testing import kill

    ckpt = train.CheckpointConfig(dir=os.path.join(spec["dir"], "ckpt"), every=spec["every"])
    config = train.TrainConfig(
        workers=WORKERS, steps=spec["steps"], global_batch_size=WORKERS * BATCH_PER_RANK,
        seed=0, report_every=10, cpus_per_worker=1.0, spares=spec["spares"],
        checkpoint=ckpt,
        faults=[kill(rank=spec["kill_rank"], at_step=spec["kill_step"])],
    )  # fmt: skip
    result = train.fit("raymesh.examples.mlp:build_bench", config)
    ends = {int(h["step"]): h["end"] for h in result.history}
    [failure] = result.failures
    k = spec["kill_step"]
    return {
        "kill_to_first_step_s": round(ends[k] - ends[k - 1], 3),
        "steps_recomputed": failure.steps_recomputed,
        "detected_to_first_step_s": round(failure.recovery_s or 0.0, 3),
        "normal_step_s": round(ends[k - 1] - ends[k - 2], 3),
        "final_step": int(result.history[-1]["step"]),
    }


def run_child(kind: str, spec: dict[str, Any], td: str, timeout: float) -> dict[str, Any]:
    """One measurement in a fresh python, in a session of its own (killed as a whole after)."""
    tag = f"{kind}{spec.get('spares', '')}"
    spec = {**spec, "kind": kind, "dir": os.path.join(td, tag), "out": os.path.join(td, tag)}
    spec["log"], spec["marker"] = os.path.join(td, tag + "_steps"), os.path.join(td, tag + ".kill")
    os.makedirs(spec["dir"], exist_ok=True)
    env = {**os.environ, **CHILD_ENV, "RAY_TMPDIR": td}  # never join another Ray on the machine
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    t0 = time.time()
    rc = run_isolated(cmd, env, timeout)
    if rc != 0:
        raise RuntimeError(f"{tag}: {'timed out' if rc is None else f'exited with {rc}'}")
    result = json.loads(Path(spec["out"] + ".json").read_text())
    return {**result, "wall_s": round(time.time() - t0, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="60 steps, kill at 40, checkpoint every 10")
    p.add_argument("--only", help="run only these systems, comma-separated (e.g. torchrun)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--torchrun-rank", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.torchrun_rank:
        torchrun_rank(json.loads(args.torchrun_rank))
        return
    if args.child:
        spec = json.loads(args.child)
        fn = {"raymesh": raymesh_child, "ray_train": ray_train_child, "torchrun": torchrun_child}
        Path(spec["out"] + ".json").write_text(json.dumps(fn[spec["kind"]](spec)))
        return

    import ray

    import raymesh

    steps, kill_step, every = (60, 40, 10) if args.quick else (200, 100, 20)
    spec = {"steps": steps, "kill_step": kill_step, "kill_rank": 1, "every": every}
    res: dict[str, Any] = {
        "bench": "recovery",
        "mode": "quick" if args.quick else "full",
        "job": f"MLP 784-1024-1024-10, SGD, {WORKERS} ranks x batch {BATCH_PER_RANK}, {steps} "
        f"steps, SIGKILL of rank 1 at step {kill_step}, checkpoints every {every}",
        "versions": dict(python=platform.python_version(), torch=torch.__version__,
                         ray=ray.__version__, raymesh=raymesh.__version__, cpus=os.cpu_count()),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }  # fmt: skip
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench_recovery_", ignore_cleanup_errors=True) as td:
        for name, kind, extra in (
            ("raymesh_warm_spare", "raymesh", {"spares": 1}),
            ("raymesh_no_spare", "raymesh", {"spares": 0}),
            ("ray_train", "ray_train", {}),
            ("torchrun", "torchrun", {}),
        ):
            if args.only and name not in args.only.split(","):
                continue
            try:
                runs[name] = run_child(kind, {**spec, **extra}, td, timeout=600)
            except Exception as e:  # keep what the other systems measured
                runs[name] = {"failed": f"{type(e).__name__}: {e}"}
            log(f"{name}: {runs[name]}")
    report = summarise(res, runs)
    print(table(report), file=sys.stderr)
    print(json.dumps(report))
    sys.exit(1 if report["failed"] else 0)


def summarise(res: dict[str, Any], runs: dict[str, Any]) -> dict[str, Any]:
    """The report: every system's figures, ratios and targets where both sides were measured
    (None where one was not), and each system that failed with its error (`failed`)."""
    ok = {k: r for k, r in runs.items() if "failed" not in r}
    ray_train = ok.get("ray_train", {}).get("kill_to_first_step_s")
    ratios = {
        f"{k}_over_ray_train": round(ok[k]["kill_to_first_step_s"] / ray_train, 3)
        if k in ok and ray_train
        else None
        for k in ("raymesh_warm_spare", "raymesh_no_spare", "torchrun")
        if k in runs
    }

    def at_most(value: float | None, limit: float) -> bool | None:
        return None if value is None else value <= limit

    spare = ok.get("raymesh_warm_spare", {}).get("kill_to_first_step_s")
    raymesh = [ok[k] for k in ("raymesh_warm_spare", "raymesh_no_spare") if k in ok]
    res.update(runs=runs, ratios=ratios, ray_train_published=RAY_TRAIN_PUBLISHED)
    res["failed"] = {k: r["failed"] for k, r in runs.items() if "failed" in r}
    res["targets"] = {
        "vs_ray_train_max": TARGET_VS_RAY_TRAIN,
        "warm_spare_max_s": TARGET_SPARE_S,
        "steps_recomputed_max": TARGET_RECOMPUTED,
        "warm_spare_vs_ray_train_met": at_most(
            ratios.get("raymesh_warm_spare_over_ray_train"), TARGET_VS_RAY_TRAIN
        ),
        "no_spare_vs_ray_train_met": at_most(
            ratios.get("raymesh_no_spare_over_ray_train"), TARGET_VS_RAY_TRAIN
        ),
        "warm_spare_under_1s_met": None if spare is None else spare < TARGET_SPARE_S,
        "steps_recomputed_met": all(r["steps_recomputed"] <= TARGET_RECOMPUTED for r in raymesh)
        if raymesh
        else None,
    }
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return res


def table(report: dict[str, Any]) -> str:
    """The report for people: a row per system, a failed one with its error."""
    lines = [f"{'system':<20} {'kill to first step':>18} {'recomputed':>10} {'vs Ray Train':>12}"]
    for name, r in report["runs"].items():
        if "failed" in r:
            lines.append(f"{name:<20} FAILED: {r['failed']}")
            continue
        ratio = report["ratios"].get(f"{name}_over_ray_train")
        lines.append(
            f"{name:<20} {r['kill_to_first_step_s']:>16.2f} s {r['steps_recomputed']:>10} "
            f"{'' if ratio is None else f'{ratio:.3f}x':>12}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
