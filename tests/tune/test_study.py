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


def test_a_study_in_storage_resumes_keeping_finished_trials_and_rerunning_a_running_one(tmp_path):
    db = tmp_path / "study.db"
    space = {"x": tune.uniform(0.0, 0.6)}
    first = tune.run(BUILD, _config(), space=space, trials=2, scheduler=None, storage=str(db))
    assert [t.state for t in first.trials] == ["complete", "complete"]
    with pytest.raises(ValueError, match="already holds a study"):
        tune.run(BUILD, _config(), space=space, trials=3, storage=str(db))
    # A controller that died mid-trial leaves it RUNNING in the database.
    stored = optuna.load_study(study_name="raymesh", storage=f"sqlite:///{db}")
    left_running = stored.ask({"x": optuna.distributions.FloatDistribution(0.0, 0.6)})
    resumed = tune.run(
        BUILD, _config(), space=space, trials=3, scheduler=None, storage=str(db), resume=True
    )
    assert [t.state for t in resumed.trials] == ["complete"] * 3
    assert [t.params for t in resumed.trials[:2]] == [t.params for t in first.trials]
    assert resumed.trials[2].params == left_running.params  # run again, same parameters


def test_raymesh_tune_runs_a_job_file_and_prints_its_trials(tmp_path, capsys):
    from raymesh.cli.main import main

    job = tmp_path / "study.toml"
    job.write_text(
        f"""
build = "{BUILD}"
workers = 1
steps = 3
global_batch_size = 4

[tune]
trials = 2
sampler = "grid"
scheduler = "median"
storage = "{tmp_path / "runs" / "study.db"}"

[tune.space]
x = "choice([0.3, 0.6])"
"""
    )
    assert main(["tune", str(job)]) == 0
    out = capsys.readouterr().out
    assert "trial  state" in out and "best: trial" in out and "'x': 0.3" in out
    assert (tmp_path / "runs" / "results.csv").exists()
