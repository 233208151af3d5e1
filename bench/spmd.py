"""`raymesh run` against `torchrun`, on one 2-rank DDP script (issue 38's SPMD targets).

    python bench/spmd.py                # 3 rounds, medians (~2 min on 2 cores)
    python bench/spmd.py --save         # also write bench/results/spmd.json

Issue 38's targets, both sides in one run on one machine:
  launch      from the command's start to the script's first trained step on every rank:
              `raymesh run` within 1.2x `torchrun`'s
  restart     from a rank's SIGKILL (its last act: the time is written first) to the first
              step of the restarted group: `raymesh run --max-restarts 1` within 0.5x
              `torchrun`'s (given 3 restarts: its restarted group's gloo rendezvous can fail,
              "Connection refused" from an address of the first group, or hang, on torch
              2.13 here)
The script: a 2-rank DDP MLP (gloo), 30 steps of 64 samples, each rank writing the wall time
of its first step; with KILL set, rank 1 SIGKILLs itself at step 10 of the first attempt.
`raymesh run` starts the embedded local Ray each time, as a fresh command does; with
`--runtime` the bench starts a local runtime first (`raymesh up`, stopped at the end) and every
`raymesh run` attaches to it, as on a machine where one is up (saved to spmd_runtime.json).
Prints one JSON object with the load average at start and end.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

SCRIPT = r"""
import os, signal, sys, time
import torch
import torch.distributed as dist

out, kill = sys.argv[1], sys.argv[2] == "kill"
dist.init_process_group("gloo")
rank = dist.get_rank()
flag = out + ".killed"
again = os.path.exists(flag)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(
    torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(30):
    x = torch.randn(64, 64)
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step == 0:
        with open(f"{out}.first.{rank}.{int(again)}", "w") as f:
            f.write(repr(time.time()))
    if kill and not again and rank == 1 and step == 10:
        with open(flag, "w") as f:
            f.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)
dist.destroy_process_group()
"""


def _command(side: str, script: Path, out: str, kill: bool) -> list[str]:
    args = [str(script), out, "kill" if kill else "run"]
    restarts = ["--max-restarts", "1"] if kill else []
    if side == "torchrun":
        # Its restarted group's gloo rendezvous can fail ("Connection refused" from an address
        # of the first group) or hang (torch 2.13): it gets 3 tries, and its time is the one
        # that trains again.
        restarts = ["--max-restarts", "3"] if kill else []
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", "2", *restarts, *args]  # fmt: skip
    return [sys.executable, "-m", "raymesh.cli.main", "run", "--nproc-per-node", "2",
            *restarts, *args]  # fmt: skip


def _once(side: str, script: Path, folder: Path, kill: bool) -> dict[str, float]:
    out = str(folder / f"{side}-{'kill' if kill else 'run'}-{time.monotonic_ns()}")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    proc = subprocess.Popen(
        _command(side, script, out, kill),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its workers too are ended if it hangs
    )
    try:
        _, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:  # torchrun's restarted group can hang in its rendezvous
        # Its workers run in sessions of their own and hold the stderr pipe: kill the whole
        # tree, not only the group, or the bench waits on them forever.
        tree = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGKILL)
        for child in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        proc.communicate(timeout=60)
        return {"failed": 1.0}
    if proc.returncode != 0:
        print(f"{side} failed ({proc.returncode}):\n{err[-2000:]}", file=sys.stderr)
        return {"failed": 1.0}
    first = max(float(Path(f"{out}.first.{r}.0").read_text()) for r in (0, 1))
    row = {"launch_s": first - start, "wall_s": time.time() - start}
    if kill:
        killed = float(Path(f"{out}.killed").read_text())
        again = max(float(Path(f"{out}.first.{r}.1").read_text()) for r in (0, 1))
        row["restart_s"] = again - killed
    return row


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over the rounds that measured it (-1: a run that failed or hung,
    counted apart)."""
    out = {"failed_runs": float(sum(1 for r in rows for v in r.values() if v == -1.0))}
    for key in ("launch_s", "wall_s", "restart_s"):
        got = [r[key] for r in rows if r.get(key, -1.0) >= 0]
        out[key] = round(statistics.median(got), 3) if got else -1.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--runtime", action="store_true", help="attach to `raymesh up`")
    args = parser.parse_args()
    if args.runtime:
        cli = [sys.executable, "-m", "raymesh.cli.main"]
        subprocess.run([*cli, "up"], check=True, stdout=subprocess.DEVNULL, timeout=300)
        time.sleep(10)  # its warm procs start in the background: measured after, not during
    try:
        result = _bench(args.rounds)
    finally:
        if args.runtime:
            subprocess.run([*cli, "down"], stdout=subprocess.DEVNULL, timeout=300)
    result["note"] = (
        "attached to a local runtime (raymesh up)"
        if args.runtime
        else "embedded Ray per command (no `raymesh up`)"
    )
    print(json.dumps(result, indent=1))
    if args.save:
        name = "spmd_runtime.json" if args.runtime else "spmd.json"
        path = Path(__file__).parent / "results" / name
        path.write_text(json.dumps(result, indent=1) + "\n")


def _bench(rounds: int) -> dict[str, object]:
    load_start = os.getloadavg()
    rows: dict[str, list[dict[str, float]]] = {"torchrun": [], "raymesh": []}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ddp.py"
        script.write_text(SCRIPT)
        for i in range(rounds):
            order = ["torchrun", "raymesh"] if i % 2 == 0 else ["raymesh", "torchrun"]
            for side in order:
                launch = _once(side, script, Path(tmp), kill=False)
                heal = _once(side, script, Path(tmp), kill=True)
                rows[side].append({**launch, "restart_s": heal.get("restart_s", -1.0)})
    med = {side: _medians(rs) for side, rs in rows.items()}
    result = {
        "bench": "raymesh run vs torchrun, 2-rank DDP script",
        "rounds": rows,
        "median": med,
        "launch_ratio": round(med["raymesh"]["launch_s"] / med["torchrun"]["launch_s"], 2),
        "restart_ratio": round(med["raymesh"]["restart_s"] / med["torchrun"]["restart_s"], 2),
        "targets": {"launch_ratio": "<= 1.2", "restart_ratio": "<= 0.5"},
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
    }
    return result


if __name__ == "__main__":
    main()
