"""Load-balancing benchmark: one of 4 ranks made 2x slower, steps/s with and without rebalancing,
in one run.

    python bench/balance.py            # 160 steps each, steady window from step 60 (~3 min)
    python bench/balance.py --quick    # 60 steps each, window from step 30

The job: MLP 784-1024-1024-10, SGD(lr=0.01), 4 ranks, global batch 256 (64 per rank when even),
CPU gloo, one thread per rank, `slow(rank=3, factor=2.0)` from step 1 (rank 3 sleeps as long as
its own compute, so its steps take twice as long). Two fits in one Ray session, alternating
without/with `rebalance=True`, twice (A B A B), each figure the mean of its two runs. Steady
steps/s = (last - first) / (end[last] - end[first]) over `Result.history`'s per-step end times
(rebalancing decides after a few reports, so the window starts after that). Also reported: the
split the policy chose, and whether the final losses agree (the split must not change the math
beyond float rounding). Progress to stderr, one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

import torch

TARGET = 1.3
BUILD = "raymesh.examples.mlp:build_bench"


def log(msg: str) -> None:
    print(f"[balance-bench] {msg}", file=sys.stderr, flush=True)


def fit(steps: int, first: int, rebalance: bool) -> dict[str, Any]:
    from raymesh import train
    from raymesh.testing import slow

    config = train.TrainConfig(
        workers=4, steps=steps, global_batch_size=256, seed=0, report_every=5,
        cpus_per_worker=1.0, rebalance=rebalance, faults=[slow(rank=3, factor=2.0)],
    )  # fmt: skip
    result = train.fit(BUILD, config)
    ends = {int(h["step"]): h["end"] for h in result.history}
    return {
        "steps_per_s": round((steps - first) / (ends[steps] - ends[first]), 2),
        "final_loss": round(result.history[-1]["loss"], 4),
        "split": result.rebalances[-1]["sizes"] if result.rebalances else [64, 64, 64, 64],
        "rebalances": len(result.rebalances),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="60 steps, window from step 30")
    args = p.parse_args()
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    import raymesh
    from raymesh._src.backend import ensure_ray

    steps, first = (60, 30) if args.quick else (160, 60)
    ensure_ray()
    runs: dict[str, list[dict[str, Any]]] = {"without": [], "with": []}
    for _ in range(2):
        for name in ("without", "with"):
            runs[name].append(fit(steps, first, rebalance=name == "with"))
            log(f"{name} rebalancing: {runs[name][-1]}")
    mean = {k: round(sum(r["steps_per_s"] for r in v) / len(v), 2) for k, v in runs.items()}
    speedup = round(mean["with"] / mean["without"], 3)
    losses = [r["final_loss"] for v in runs.values() for r in v]
    print(
        json.dumps(
            {
                "bench": "balance",
                "mode": "quick" if args.quick else "full",
                "job": f"MLP 784-1024-1024-10, SGD, 4 ranks, global batch 256, {steps} steps, "
                f"rank 3 slowed 2x, steady window steps {first}..{steps}",
                "versions": dict(
                    python=platform.python_version(),
                    torch=torch.__version__,
                    ray=ray.__version__,
                    raymesh=raymesh.__version__,
                    cpus=os.cpu_count(),
                ),
                "steps_per_s": mean,
                "speedup": speedup,
                "target": TARGET,
                "target_met": speedup >= TARGET,
                "final_losses_agree": max(losses) - min(losses) < 1e-3,
                "runs": runs,
            }
        )
    )


if __name__ == "__main__":
    main()
