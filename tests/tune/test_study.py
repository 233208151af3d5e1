"""raymesh.tune on real training jobs: Optuna chooses, ASHA prunes, a failing trial is recorded,
trial procs serve trial after trial, a killed worker heals inside its trial, a study whose
controller is SIGKILLed resumes, and the results are written."""

from __future__ import annotations

import csv
import signal
import statistics
import time
from pathlib import Path

import optuna
import pytest

from raymesh import train, tune
from raymesh.testing import kill
from tests.scripts import start_cli

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]

BUILD = "tests.tune.helpers:quadratic"
BOWL = "tests.tune.helpers:bowl"


def _config(**kw) -> train.TrainConfig:
    base = dict(workers=1, steps=4, global_batch_size=4, report_every=1, max_failures=0)
    return train.TrainConfig(**(base | kw))


def _builds(folder: Path) -> dict[float, set[int]]:
    """x -> the pids that built a trial of that x (helpers.quadratic notes them)."""
    out: dict[float, set[int]] = {}
    for f in folder.iterdir():
        pid, x = f.name.split("-", 1)
        out.setdefault(float(x), set()).add(int(pid))
    return out


def test_a_grid_study_finds_the_optimum_prunes_worse_trials_and_survives_a_failing_one(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    study = tune.run(
        BUILD,
        _config(),
        space={"x": tune.choice([0.0, 0.3, 0.6, 0.9]), "pids": str(pids)},
        trials=4,
        sampler="grid",
        scheduler="asha",
        storage=str(tmp_path / "study.db"),
    )
    by_x = {t.params["x"]: t for t in study.trials}
    assert sorted(by_x) == [0.0, 0.3, 0.6, 0.9]
    assert study.best.params == {"x": 0.3} and study.best.value == pytest.approx(0.0)
    assert by_x[0.9].state == "failed" and "broken configuration" in by_x[0.9].error
    pruned = [t for t in study.trials if t.state == "pruned"]
    assert all(t.value > study.best.value for t in pruned)
    # Sequential trials: one that reports worse than an earlier one at its first step stops.
    order = sorted((t for t in study.trials if t.state != "failed"), key=lambda t: t.number)
    for k, t in enumerate(order):
        beaten = any(o.curve[0][1] < t.curve[0][1] for o in order[:k])
        assert (t.state == "pruned") == beaten, (t, order)
    assert study.best.checkpoint is not None  # each trial saved in its own folder
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert len(rows) == 4 and {r["state"] for r in rows} >= {"complete", "failed"}
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert (tmp_path / "parameters.png").stat().st_size > 0
    # One proc served every trial in turn: complete, pruned (after its chunk) and failing ones.
    builds = _builds(pids)
    assert sorted(builds) == [0.0, 0.3, 0.6, 0.9]
    assert len(set().union(*builds.values())) == 1, builds


def test_tpe_chooses_better_points_than_random_search_in_as_many_trials():
    # Sequential trials (concurrent=1) with fixed seeds: each sampler's choices are a function
    # of the values told to it, so TPE does better only if the jobs' losses reach it.
    late = {}
    for sampler in ("tpe", "random"):
        study = tune.run(
            BOWL,
            _config(steps=1),
            space={"x": tune.uniform(-1.0, 1.0), "y": tune.uniform(-1.0, 1.0)},
            trials=16,
            sampler=sampler,
            scheduler=None,
        )
        values = [t.value for t in sorted(study.trials, key=lambda t: t.number)]
        assert len(values) == 16 and None not in values
        late[sampler] = statistics.mean(values[10:])  # after TPE's 10 random startup trials
    assert late["tpe"] < 0.6 * late["random"], late


def test_a_ddp_trial_heals_a_killed_worker_in_place_and_hands_its_live_procs_on(tmp_path):
    pids = tmp_path / "pids"
    pids.mkdir()
    lr = 0.1
    study = tune.run(
        BUILD,
        _config(workers=2, max_failures=1, faults=[kill(rank=1, at_step=2)]),
        space={"x": tune.choice([0.0, 0.6]), "lr": lr, "pids": str(pids)},
        trials=2,
        sampler="grid",
        scheduler=None,
    )
    assert [t.state for t in study.trials] == ["complete", "complete"]
    for t in study.trials:  # SGD on (x - 0.3)^2 from x0: the loss at step 4 is exact
        expected = ((t.params["x"] - 0.3) * (1 - 2 * lr) ** 3) ** 2
        assert t.value == pytest.approx(expected, rel=1e-5)
    first, second = (_builds(pids)[x] for x in (0.0, 0.6))
    assert len(first) == len(second) == 3  # two ranks, and the replacement of the killed one
    assert len(first & second) == 2  # the survivor and the replacement served the next trial


def _job(tmp_path: Path, db: Path) -> Path:
    job = tmp_path / "study.toml"
    job.write_text(
        f"""
build = "{BUILD}"
workers = 1
steps = 6
global_batch_size = 4

[checkpoint]
dir = "{tmp_path / "unused"}"
every = 2

[tune]
trials = 3
sampler = "grid"
scheduler = "none"
storage = "{db}"

[tune.space]
x = "choice([0.0, 0.3, 0.6])"
sleep = 0.25
"""
    )
    return job


def _trials(db: Path) -> list:
    return optuna.load_study(study_name="raymesh", storage=f"sqlite:///{db}").get_trials()


def test_a_study_whose_controller_is_sigkilled_resumes_without_rerunning_finished_trials(
    tmp_path, capsys
):
    from raymesh.cli.main import main

    db = tmp_path / "runs" / "study.db"
    job = _job(tmp_path, db)
    controller = start_cli(["tune", str(job)], tmp_path / "controller.log")
    # SIGKILL it once a trial is complete and the running one has a committed checkpoint (by
    # their folders: reading the database this often would slow the controller down).
    deadline = time.monotonic() + 120
    trials = tmp_path / "runs" / "trials"
    try:
        while True:
            assert time.monotonic() < deadline and controller.poll() is None
            saved = [sorted(d.glob("step-*/manifest.json")) for d in trials.glob("trial-*")]
            ends = [s[-1].parent.name for s in saved if s]
            if "step-00000006" in ends and len(ends) >= 2 and len(set(ends)) > 1:
                break
            time.sleep(0.1)
    finally:
        controller.send_signal(signal.SIGKILL)
        controller.wait(timeout=30)
    left = [t for t in _trials(db) if t.state == optuna.trial.TrialState.RUNNING]
    assert len(left) == 1, (tmp_path / "controller.log").read_text()[-3000:]
    running = left[0]
    before = {t.number: t.value for t in _trials(db) if t.state.name == "COMPLETE"}

    assert main(["tune", str(job), "--trials", "3"]) == 2  # the study exists: say resume
    assert "already holds a study" in capsys.readouterr().err
    assert main(["tune", str(job), "--resume"]) == 0
    assert "best: trial" in capsys.readouterr().out
    after = _trials(db)
    complete = [t for t in after if t.state.name == "COMPLETE"]
    assert sorted(t.params["x"] for t in complete) == [0.0, 0.3, 0.6]  # each point once
    assert {t.number: t.value for t in complete if t.number in before} == before  # kept
    [again] = [t for t in complete if t.params == running.params]
    assert again.user_attrs["resumed_from"] >= 2  # from the killed trial's checkpoint
    assert (db.parent / "results.csv").exists() and (db.parent / "curves.png").exists()
