"""Healing sharded jobs: what a lost rank costs FSDP and HSDP, and a failure while re-forming.

    python bench/heal_sharded.py        # ~2-3 min on 2 cores

The job for every case: the example MLP (raymesh.examples.mlp:build), 4 ranks x batch 12, 40
steps, a checkpoint every 4, CPU gloo; rank 2 is SIGKILLed as it starts step 22. Cases:
- fsdp, hsdp (2 replicas x shard groups of 2): every rank rebuilds in its warm process and
  loads the step-20 checkpoint, so steps 21 and 22 are trained again.
- ddp_join (2 ranks): rank 1 is killed at step 22 and its replacement is killed as it joins
  (`kill(..., when="join")`); the survivor, left in the rendezvous, is replaced too, and the
  state it sent before is restored from the controller.
Per failure: rank, kind ("died"; "stuck" for a survivor blocked on a failed peer, replaced and
not counted), recovery_s (detection to the first step completed after healing) and
steps_recomputed. Each case runs in a fresh subprocess; one JSON object goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _isolated import run_isolated

CASES: dict[str, dict[str, Any]] = {
    "fsdp": {"workers": 4, "strategy": "fsdp", "join": False},
    "hsdp": {"workers": 4, "strategy": "hsdp", "shard_size": 2, "join": False},
    "ddp_join": {"workers": 2, "strategy": "ddp", "join": True},
}
KILL_STEP = 22


def child(name: str, out: str, ckpt: str) -> None:
    from raymesh import train
    from raymesh.testing import kill

    case = dict(CASES[name])
    join = case.pop("join")
    victim = case["workers"] - 2 if case["workers"] > 2 else 1
    faults = [kill(rank=victim, at_step=KILL_STEP)]
    if join:
        faults.append(kill(rank=victim, at_step=KILL_STEP, when="join"))
    config = train.TrainConfig(
        steps=40, global_batch_size=48, seed=0, report_every=2, faults=faults,
        checkpoint=train.CheckpointConfig(dir=ckpt, every=4), **case,
    )  # fmt: skip
    t0 = time.time()
    result = train.fit("raymesh.examples.mlp:build", config)
    failures = [
        {
            "rank": f.rank,
            "kind": f.kind,
            "recovery_s": round(f.recovery_s or 0.0, 2),
            "steps_recomputed": f.steps_recomputed,
        }
        for f in result.failures
    ]
    Path(out).write_text(
        json.dumps(
            {
                "strategy": result.decision.strategy,
                "failures": failures,
                "final_step": int(result.history[-1]["step"]),
                "fit_s": round(time.time() - t0, 1),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch

    import raymesh

    res: dict[str, Any] = {
        "bench": "heal_sharded",
        "job": f"example MLP, 40 steps, checkpoint every 4, SIGKILL at step {KILL_STEP}",
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "raymesh": raymesh.__version__,
            "cpus": os.cpu_count(),
        },
        "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="bench_heal_", ignore_cleanup_errors=True) as td:
        for name in CASES:
            out, ckpt = os.path.join(td, name + ".json"), os.path.join(td, name)
            env = {**os.environ, "RAY_TMPDIR": td, "RAY_USAGE_STATS_ENABLED": "0"}
            cmd = [sys.executable, os.path.abspath(__file__), "--child", name, out, ckpt]
            rc = run_isolated(cmd, env, timeout=600)
            if rc != 0:
                raise RuntimeError(f"{name}: {'timed out' if rc is None else f'exit {rc}'}")
            res["runs"][name] = json.loads(Path(out).read_text())
            print(f"[heal-sharded] {name}: {res['runs'][name]}", file=sys.stderr, flush=True)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
