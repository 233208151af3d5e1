"""train.fit end to end on real procs: loss falls, determinism, resume, reshard, strategies."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from raymesh import train
from raymesh.train.checkpoint import Checkpointer, Manifest, export_state_dict

from .weights import MLP, close, equal

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]


def _config(**kw) -> train.TrainConfig:
    base = dict(workers=2, steps=12, global_batch_size=32, seed=0, report_every=4)
    base.update(kw)
    return train.TrainConfig(**base)


def test_loss_falls_on_the_mlp_and_history_has_every_step(fit):
    result = fit(MLP, _config(steps=40, report_every=10))
    losses = [h["loss"] for h in result.history]
    assert [h["step"] for h in result.history] == list(range(1, 41))
    assert sum(losses[-5:]) / 5 < 0.7 * sum(losses[:5]) / 5, losses
    assert result.decision.strategy == "ddp"
    weights = result.state_dict()
    assert weights and all(not k.startswith("module.") for k in weights)


def test_two_runs_with_the_same_seed_give_bitwise_identical_weights(fit):
    a = fit(MLP, _config()).state_dict()
    b = fit(MLP, _config()).state_dict()
    assert equal(a, b)
    c = fit(MLP, _config(seed=1)).state_dict()
    assert not equal(a, c)


def test_resuming_gives_the_same_weights_as_an_uninterrupted_run(fit, tmp_path):
    whole = fit(MLP, _config(steps=12)).state_dict()
    ckpt = train.CheckpointConfig(dir=str(tmp_path / "ckpt"), every=6)
    first = fit(MLP, _config(steps=6, checkpoint=ckpt))
    assert first.checkpoint is not None and first.checkpoint.endswith("step-00000006")
    second = fit(MLP, _config(steps=12, checkpoint=ckpt))
    assert second.resumed_from == 6
    assert [h["step"] for h in second.history] == list(range(7, 13))
    assert equal(whole, second.state_dict())
    rows = [json.loads(x) for x in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    if importlib.util.find_spec("tensorboard") is not None:
        assert any((tmp_path / "ckpt" / "tensorboard").iterdir())


def test_a_checkpoint_saved_at_four_workers_resumes_at_two(fit, tmp_path):
    ckpt = train.CheckpointConfig(dir=str(tmp_path / "ckpt"), every=6)
    four = dict(workers=4, global_batch_size=32)
    reference = fit(MLP, _config(steps=12, **four)).state_dict()
    fit(MLP, _config(steps=6, checkpoint=ckpt, **four))
    resumed = fit(MLP, _config(steps=12, checkpoint=ckpt, workers=2))
    assert resumed.resumed_from == 6
    assert close(reference, resumed.state_dict(), rtol=1e-4, atol=1e-6)


def test_fsdp_and_ddp_agree_on_the_same_seed(fit):
    ddp = fit(MLP, _config(strategy="ddp"))
    fsdp = fit(MLP, _config(strategy="fsdp"))
    assert fsdp.decision.strategy == "fsdp"
    assert close(ddp.state_dict(), fsdp.state_dict(), rtol=1e-4, atol=1e-6)


def test_auto_picks_fsdp_when_the_budget_is_below_the_ddp_estimate(fit):
    probe = fit(MLP, _config(steps=1))
    est = probe.decision.estimate
    between = (est.ddp_bytes() + est.fsdp_bytes(2)) / 2 / 0.8  # fits sharded, not replicated
    result = fit(MLP, _config(steps=2, memory_budget_gb=between / 2**30))
    assert result.decision.strategy == "fsdp", result.decision.reason
    assert "fsdp" in result.decision.reason


def test_a_corrupted_newest_checkpoint_is_skipped_with_a_warning_and_the_previous_one_resumed(
    fit, tmp_path, caplog
):
    ckpt = train.CheckpointConfig(dir=str(tmp_path / "ckpt"), every=4, keep=3)
    fit(MLP, _config(steps=8, checkpoint=ckpt))
    newest = tmp_path / "ckpt" / "step-00000008"
    victim = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    victim.write_bytes(b"\0" * 16 + victim.read_bytes()[16:])
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        resumed = fit(MLP, _config(steps=10, checkpoint=ckpt))
    assert resumed.resumed_from == 4
    said = [r.getMessage() for r in caplog.records if r.name == "raymesh"]
    assert any(
        str(newest) in m and repr(victim.name) in m and "fails its checksum" in m for m in said
    ), said
    # Resumed from step 4's checkpoint (neither the corrupt one nor from scratch): steps 5-10
    # are trained, to the weights of an uninterrupted 10-step run, bit for bit.
    assert [h["step"] for h in resumed.history] == list(range(5, 11))
    assert equal(fit(MLP, _config(steps=10)).state_dict(), resumed.state_dict())


def test_async_checkpoints_are_committed_loadable_and_hold_what_blocking_saves_hold(fit, tmp_path):
    runs = {}
    for name, async_save in (("sync", False), ("async", True)):
        ckpt = train.CheckpointConfig(dir=str(tmp_path / name), every=4, async_save=async_save)
        runs[name] = fit(MLP, _config(steps=12, checkpoint=ckpt))
    assert equal(runs["sync"].state_dict(), runs["async"].state_dict())
    steps = ["step-00000004", "step-00000008", "step-00000012"]
    folder = tmp_path / "async"
    # All committed by the end: no save left in flight (.tmp-*).
    saved = sorted(p.name for p in folder.iterdir() if p.name.startswith(("step-", ".tmp-")))
    assert saved == steps
    assert Checkpointer(folder).latest() == folder / steps[-1]
    assert runs["async"].checkpoint == str(folder / steps[-1])
    for step in steps:
        manifest = Manifest.from_json((folder / step / "manifest.json").read_text())
        assert (manifest.step, manifest.world_size) == (int(step[5:]), 2)
        # Each holds the state at its step (the save did not see the steps trained while it
        # was written): the blocking save's, bit for bit.
        assert equal(export_state_dict(tmp_path / "sync" / step), export_state_dict(folder / step))
    assert equal(export_state_dict(folder / steps[-1]), runs["async"].state_dict())


def test_the_tiny_gpt_learns_from_the_standard_library(fit):
    cfg = train.TrainConfig(workers=2, steps=30, global_batch_size=16, report_every=10)
    losses = [h["loss"] for h in fit("raymesh.examples.tinygpt:build", cfg).history]
    assert losses[-1] < losses[0] - 0.5, losses


BAD = {
    "unknown field": ("workers = 2\nsteps = 2\nglobal_batch_size = 4\nwrokers = 3\n", "wrokers"),
    "workers=0": ("workers = 0\nsteps = 2\nglobal_batch_size = 4\n", "workers=0"),
    "steps<1": ("workers = 2\nsteps = 0\nglobal_batch_size = 4\n", "steps=0"),
    "batch too small": ("workers = 3\nsteps = 2\nglobal_batch_size = 2\n", "no samples"),
    "elastic min > max": ("workers = [4, 2]\nsteps = 2\nglobal_batch_size = 4\n", "min must be"),
    "unknown strategy": (
        'workers = 1\nsteps = 1\nglobal_batch_size = 1\nstrategy = "zero"\n',
        "strategy='zero'",
    ),
    "build not importable": (
        'workers = 1\nsteps = 1\nglobal_batch_size = 1\nbuild = "no_such_module:build"\n',
        "no_such_module",
    ),
}


def _job(tmp_path, case: str):
    text, expected = BAD[case]
    if "build" not in text:
        text += f'build = "{MLP}"\n'
    job = tmp_path / "job.toml"
    job.write_text(text)
    return job, expected


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_configs_give_one_clear_error_and_no_traceback(case, tmp_path, capsys):
    from raymesh.cli.main import main

    job, expected = _job(tmp_path, case)
    assert main(["train", str(job)]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err, err


def test_the_train_command_exits_2_on_a_bad_config(tmp_path):
    job, expected = _job(tmp_path, "unknown field")  # the whole process, as a user runs it
    out = subprocess.run(
        [sys.executable, "-m", "raymesh.cli.main", "train", str(job)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert out.returncode == 2, out.stderr
    assert expected in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_readmes_main_job_heals_and_the_terminal_tells_each_event_once(tmp_path):
    """The README's main job as a user runs it (its own embedded Ray; fewer steps; with the
    dashboard the README offers): it heals, and what it prints is raymesh's: one line for the
    failure with its root cause, none of Ray's paragraphs on a dead worker or its token
    warning, no gloo error text; the run folder has its events, metrics and picture."""
    from PIL import Image

    job = Path(__file__).resolve().parents[2] / "examples" / "tinygpt.toml"
    unset = ("RAY_ADDRESS", "RAYMESH_ADDRESS", "RAY_AUTH_MODE")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    argv = ["train", str(job), "--steps", "60", "--inject", "kill:rank=1:step=30"]
    argv += ["--dashboard", "--dashboard-port", "0"]
    out = subprocess.run(
        [sys.executable, "-m", "raymesh.cli.main", *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert re.search(
        r"^healed: rank 1 at step 30: died: proc \(pid \d+\) killed by SIGKILL", text, re.M
    )
    [healing] = [line for line in text.splitlines() if "-> Healing" in line]
    assert re.fullmatch(
        r"raymesh\.train: -> Healing \(rank 1 died: proc \(pid \d+\) killed by SIGKILL; "
        r"ranks 0, 2, 3 saw their peer go\)",
        healing,
    ), healing
    assert "A worker died or was killed" not in text, text  # Ray's paragraph on the death
    assert "Token authentication" not in text, text
    assert "gloo" not in text and "Traceback" not in text, text
    run = tmp_path / "runs" / "tinygpt"
    assert re.search(r"^dashboard: http://127\.0\.0\.1:\d+/run/tinygpt$", text, re.M), text
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    healed = [e for e in events if e["event"] == "healed"]
    assert [(e["rank"], e["step"], e["action"]) for e in healed] == [(1, 30, "replace")], text
    assert re.search(r"^picture: runs/tinygpt/run\.png$", text, re.M), text
    assert "recruiting failed" not in text, text  # a spare cut short by the job's end
    with Image.open(run / "run.png") as image:
        assert image.format == "PNG" and image.size == (990, 660)
    assert len((run / "metrics.jsonl").read_text().splitlines()) >= 60


def test_config_is_validated_in_python_too():
    with pytest.raises(ValueError, match=r"global_batch_size=3: gives some of the 4 workers"):
        train.TrainConfig(workers=(2, 4), global_batch_size=3)
    with pytest.raises(ValueError, match=r"workers=\(1, 2, 3\)"):
        train.TrainConfig(workers=(1, 2, 3))  # type: ignore[arg-type]
    elastic = train.TrainConfig.from_dict({"workers": [2, 4], "global_batch_size": 8})
    assert (elastic.min_workers, elastic.max_workers) == (2, 4)
    with pytest.raises(ValueError, match=r"TrainConfig has unknown key\(s\) \['stpes'\]"):
        train.TrainConfig.from_dict({"stpes": 3})
    base = _config()
    with pytest.raises(ValueError, match="micro_batch_size=0"):
        dataclasses.replace(base, micro_batch_size=0)
    with pytest.raises(ValueError, match="shard_size=2: is for strategy 'hsdp'"):
        train.TrainConfig(workers=4, global_batch_size=8, strategy="ddp", shard_size=2)
    with pytest.raises(ValueError, match=r"shard_size=3: must split workers=4 .* divisor of 4"):
        train.TrainConfig(workers=4, global_batch_size=8, strategy="hsdp", shard_size=3)


def test_gradient_accumulation_matches_one_big_micro_batch(fit):
    whole = fit(MLP, _config(steps=6)).state_dict()
    accumulated = fit(MLP, _config(steps=6, micro_batch_size=4)).state_dict()
    assert close(whole, accumulated, rtol=1e-5, atol=1e-6)
