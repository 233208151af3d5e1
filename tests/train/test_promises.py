"""Promises of docs/training.md that need a real job of their own: `raymesh train --resume`
after the controller process was SIGKILLed, and what a rank's code sees of its world (the
torch.distributed environment variables, `cpus_per_worker` intra-op threads).

The build functions here run in the ranks (they import this module by name)."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from raymesh import train
from raymesh.examples import mlp
from raymesh.testing import kill
from raymesh.train.checkpoint import export_state_dict

from ..scripts import start_cli
from ..waiting import alive, wait_for
from .weights import equal

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def record_env(ctx: train.Context) -> train.Task:
    """mlp.build, noting what the rank sees as it builds: the env, torch's threads."""
    seen = {k: os.environ.get(k) for k in ENV}
    seen.update(rank=ctx.rank, threads=torch.get_num_threads(), pid=os.getpid())
    folder = Path(ctx.params["record"])
    (folder / f"{time.time_ns()}-{os.getpid()}.json").write_text(json.dumps(seen))
    return mlp.build(ctx)


def held(ctx: train.Context) -> train.Task:
    """mlp.build whose loss blocks once the checkpoint of step `hold_after` is committed,
    unless the file `gate` exists: a run that stops at a known step until it is killed. The
    math is mlp.build's."""
    task = mlp.build(ctx)
    done = Path(ctx.params["dir"]) / f"step-{ctx.params['hold_after']:08d}" / "manifest.json"
    gate = Path(ctx.params["gate"])
    loss_fn = task.loss_fn

    def loss(model: torch.nn.Module, batch: object) -> torch.Tensor:
        while done.exists() and not gate.exists():
            time.sleep(0.05)
        return loss_fn(model, batch)

    return dataclasses.replace(task, loss_fn=loss)


def test_ranks_see_the_torch_distributed_env_and_cpus_per_worker_threads(tmp_path):
    # Rank 1 is killed at step 3: its replacement builds as rank 1 of the re-formed world.
    record = tmp_path / "record"
    record.mkdir()
    config = train.TrainConfig(
        workers=2,
        steps=4,
        global_batch_size=16,
        cpus_per_worker=2,
        params={"record": str(record)},
        faults=[kill(rank=1, at_step=3)],
    )
    result = train.fit(record_env, config)
    assert len(result.failures) == 1
    seen = [json.loads(p.read_text()) for p in sorted(record.iterdir())]
    assert len(seen) == 3, seen  # ranks 0 and 1, then rank 1's replacement
    first, replacement = sorted(seen[:2], key=lambda s: s["rank"]), seen[2]
    for rank, s in enumerate(first):
        assert s["rank"] == rank and s["RANK"] == str(rank), s
        assert (s["WORLD_SIZE"], s["LOCAL_RANK"], s["LOCAL_WORLD_SIZE"]) == ("2", str(rank), "2")
        assert s["threads"] == 2, s
    assert first[0]["MASTER_ADDR"] == first[1]["MASTER_ADDR"] and first[0]["MASTER_ADDR"]
    assert first[0]["MASTER_PORT"] == first[1]["MASTER_PORT"] and int(first[0]["MASTER_PORT"])
    assert replacement["pid"] not in {s["pid"] for s in first}
    assert (replacement["rank"], replacement["RANK"], replacement["WORLD_SIZE"]) == (1, "1", "2")
    assert replacement["MASTER_ADDR"] == first[0]["MASTER_ADDR"]
    assert int(replacement["MASTER_PORT"]) > 0 and replacement["threads"] == 2


def test_train_resume_after_the_controller_was_sigkilled_ends_with_the_uninterrupted_weights(
    tmp_path, capsys
):
    from raymesh.cli.main import main

    run, gate = tmp_path / "run", tmp_path / "gate"
    job = tmp_path / "job.toml"
    job.write_text(
        f'build = "tests.train.test_promises:held"\nworkers = 2\nsteps = 12\n'
        f"global_batch_size = 16\nreport_every = 2\nspares = 1\n"
        f'params = {{dir = "{run}", gate = "{gate}", hold_after = 8}}\n'
        f'[checkpoint]\ndir = "{run}"\nevery = 4\n'
    )
    controller = start_cli(["train", str(job)], tmp_path / "controller.log", cwd=ROOT)
    # The ranks hold at step 9, once step 8's checkpoint is committed: SIGKILL the controller
    # mid-run then.
    deadline = time.monotonic() + 150
    try:
        while not (run / "step-00000008" / "manifest.json").exists():
            assert controller.poll() is None, (tmp_path / "controller.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "controller.log").read_text()[-3000:]
            time.sleep(0.1)
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=30)
    # Every proc of the killed job (ranks, with their monitors, and the spare) ends with it.
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    procs = {
        p["pid"]: p["mesh"]
        for e in events
        if e["event"] == "mesh"
        for p in e["ranks"] + e["spares"]
    }
    assert sorted(m.split("-")[0] for m in procs.values()) == ["spare", "trainer", "trainer"]
    wait_for(
        lambda: not any(map(alive, procs)), 10, what=f"the killed controller's procs {procs} gone"
    )
    before = len((run / "metrics.jsonl").read_text().splitlines())

    gate.touch()
    assert main(["train", str(job), "--resume"]) == 0
    assert "done: step 12" in capsys.readouterr().out
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows[before:]] == [9, 10, 11, 12]  # resumed from step 8
    config = train.load_config(job)
    clean = train.fit(held, dataclasses.replace(config, checkpoint=None, spares=0))
    assert equal(clean.state_dict(), export_state_dict(run / "step-00000012"))
