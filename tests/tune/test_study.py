"""raymesh.tune on real training jobs: Optuna chooses, ASHA prunes, a failing trial is recorded,
a study in storage resumes, and the results are written."""

from __future__ import annotations

import csv

import optuna
import pytest

from raymesh import train, tune

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]

BUILD = "tests.tune.helpers:quadratic"


def _config(**kw) -> train.TrainConfig:
    base = dict(workers=1, steps=4, global_batch_size=4, report_every=1, max_failures=0)
    return train.TrainConfig(**(base | kw))


def test_a_grid_study_finds_the_optimum_prunes_worse_trials_and_survives_a_failing_one(tmp_path):
    study = tune.run(
        BUILD,
        _config(),
        space={"x": tune.choice([0.0, 0.3, 0.6, 0.9])},
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


def test_raymesh_tune_runs_a_job_file_and_a_resumed_study_reruns_only_a_trial_left_running(
    tmp_path, capsys
):
    from raymesh.cli.main import main

    db = tmp_path / "runs" / "study.db"
    job = tmp_path / "study.toml"
    job.write_text(
        f"""
build = "{BUILD}"
workers = 1
steps = 3
global_batch_size = 4

[tune]
trials = 2
sampler = "random"
scheduler = "median"
storage = "{db}"

[tune.space]
x = "uniform(0.0, 0.6)"
"""
    )
    assert main(["tune", str(job)]) == 0
    out = capsys.readouterr().out
    assert "trial  state" in out and "best: trial" in out
    assert (tmp_path / "runs" / "results.csv").exists()
    assert main(["tune", str(job), "--trials", "3"]) == 2  # the study exists: say resume
    assert "already holds a study" in capsys.readouterr().err
    first = optuna.load_study(study_name="raymesh", storage=f"sqlite:///{db}").trials
    # A controller that died mid-trial leaves it RUNNING in the database.
    stored = optuna.load_study(study_name="raymesh", storage=f"sqlite:///{db}")
    left_running = stored.ask({"x": optuna.distributions.FloatDistribution(0.0, 0.6)})
    assert main(["tune", str(job), "--trials", "3", "--resume"]) == 0
    resumed = tune.run(
        BUILD,
        _config(steps=3),
        space={"x": tune.uniform(0.0, 0.6)},
        trials=3,
        scheduler="median",
        storage=str(db),
        resume=True,
    )  # all 3 done: runs nothing more
    assert [t.state for t in resumed.trials] == ["complete"] * 3
    assert [t.params for t in resumed.trials[:2]] == [t.params for t in first]
    assert resumed.trials[2].params == left_running.params  # run again, same parameters
