"""A sustained failure rate: the README's job under a SIGKILL every `every_s` seconds.

    python bench/chaos.py --rate                       # 10 minutes, a SIGKILL every 30 s
    python bench/chaos.py --rate --minutes 3 --every 20 --seed 1

The README's job (examples/tinygpt.toml: 4 ranks, a warm spare) runs twice, with the same
steps: once without faults, then with a killer thread that every `every_s` seconds SIGKILLs one
rank's proc, drawn from a seeded generator among the ranks alive in the job's newest "mesh"
event (the run folder's events.jsonl, as the dashboard reads it), at whatever point of its
step it is. The steps are chosen so that the fault-free run lasts about `minutes`.

Reported: effective training time, the fault-free run's seconds over the faulted run's (steps
per second with faults against without: torchft reports 81.2 % at one failure a minute on 300
GPUs, dropping the interrupted batches; raymesh drops none), the kills landed and healed, the
steps recomputed, and the promise: every step once in the history and the final weights bit for
bit the fault-free run's.

A module of its own (chaos.py is the campaign of short runs; this is one long pair of runs).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "tinygpt.toml"


def _alive_rank_pids(events: Path) -> dict[int, int]:
    """rank -> pid of the ranks alive in the newest "mesh" event of a run folder."""
    newest: dict[str, Any] | None = None
    try:
        lines = events.read_text().splitlines()
    except FileNotFoundError:
        return {}
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # a line being written
            continue
        if event.get("event") == "mesh":
            newest = event
    if newest is None:
        return {}
    return {int(p["rank"]): int(p["pid"]) for p in newest["ranks"] if p["state"] == "alive"}


@dataclasses.dataclass
class Killer:
    """SIGKILLs a random live rank every `every_s` seconds until stopped."""

    events: Path
    every_s: float
    seed: int
    kills: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)

    def run(self, t0: float) -> None:
        rng = random.Random(self.seed)
        while not self._stop.wait(self.every_s):
            pids = _alive_rank_pids(self.events)
            if not pids:
                continue
            rank = rng.choice(sorted(pids))
            try:
                os.kill(pids[rank], signal.SIGKILL)
            except ProcessLookupError:  # it died or was replaced since the event
                continue
            self.kills.append({"t_s": round(time.monotonic() - t0, 1), "rank": rank})
            print(f"[rate] SIGKILL rank {rank} (pid {pids[rank]})", file=sys.stderr, flush=True)

    def stop(self) -> None:
        self._stop.set()


def _config(steps: int, run_dir: str, max_failures: int) -> Any:
    from raymesh import train

    config = train.load_config(JOB, build=True)
    return dataclasses.replace(
        config,
        steps=steps,
        run_dir=run_dir,
        checkpoint=None,  # healing in place; the run folder's checkpoints are not the point
        max_failures=max_failures,
    )


def rate_run(*, minutes: float, every_s: float, seed: int) -> dict[str, Any]:
    """The fault-free run and the faulted one, and what they showed (plain data)."""
    import torch

    from raymesh import train

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="raymesh-rate-") as tmp:
        # A short run first: its steady steps per second (from its first report on, so the
        # start is not counted), so the pair lasts about `minutes` each.
        seen: list[tuple[float, int]] = []
        train.fit(
            None,
            _config(120, f"{tmp}/probe", 0),
            progress=lambda p: seen.append((time.monotonic(), int(p["step"]))),
        )
        (t0, s0), (t1, s1) = seen[0], seen[-1]
        rate = (s1 - s0) / max(t1 - t0, 1e-9)
        steps = max(100, int(rate * minutes * 60))
        print(f"[rate] ~{rate:.1f} steps/s: {steps} steps a run", file=sys.stderr, flush=True)
        t = time.monotonic()
        clean = train.fit(None, _config(steps, f"{tmp}/clean", 0))
        clean_s = time.monotonic() - t
        expected_kills = int(clean_s / every_s) + 2
        killer = Killer(Path(tmp) / "faulted" / "events.jsonl", every_s, seed)
        t = time.monotonic()
        thread = threading.Thread(target=killer.run, args=(t,), daemon=True)
        thread.start()
        try:
            faulted = train.fit(None, _config(steps, f"{tmp}/faulted", 4 * expected_kills))
        finally:
            killer.stop()
            thread.join(timeout=5)
        faulted_s = time.monotonic() - t
    a, b = clean.state_dict(), faulted.state_dict()
    differing = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    steps_once = [h["step"] for h in faulted.history] == [h["step"] for h in clean.history]
    return {
        "benchmark": "chaos_rate",
        "job": str(JOB.relative_to(ROOT)),
        "steps": steps,
        "every_s": every_s,
        "seed": seed,
        "clean_s": round(clean_s, 1),
        "faulted_s": round(faulted_s, 1),
        "effective_training_time": round(clean_s / faulted_s, 4),
        "target": 0.95,
        "kills": killer.kills,
        "failures_recorded": len(faulted.failures),
        "healed": sum(f.action in ("replace", "shrink") for f in faulted.failures),
        "steps_recomputed": sum(f.steps_recomputed or 0 for f in faulted.failures),
        "recovery_s": [round(f.recovery_s or 0.0, 2) for f in faulted.failures],
        "every_step_once": steps_once,
        "bitwise_equal": not differing,
        "tensors_differing": differing[:6],
        "held": steps_once and not differing,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "host": {"cpus": os.cpu_count()},
    }
