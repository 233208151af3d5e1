"""raymesh.tune's input, checked before any trial starts (no Ray)."""

from __future__ import annotations

import pytest

from raymesh import train, tune
from raymesh.tune.space import domains


def _run(**kw):
    args = dict(space={"lr": tune.loguniform(1e-4, 1e-1)}, trials=2)
    return tune.run("tests.tune.helpers:quadratic", train.TrainConfig(), **(args | kw))


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"space": {}}, "give a dict of parameters"),
        ({"space": {"lr": 0.1}}, "no domain to search"),
        ({"space": {"lr": tune.loguniform(0, 1)}}, "a log domain needs low > 0"),
        ({"space": {"lr": tune.uniform(1, 1)}}, "low=1.0 must be below high=1.0"),
        ({"space": {"w": tune.choice([])}}, "give at least one option"),
        ({"scheduler": "pbt"}, "scheduler='pbt'"),
        ({"metric": "accuracy"}, "metric='accuracy'"),
        ({"mode": "lowest"}, "mode='lowest'"),
        ({"trials": 0}, "trials=0"),
        ({"sampler": "grid"}, "sampler='grid' needs choice"),
    ],
)
def test_bad_input_is_an_error_naming_it_before_any_trial(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        _run(**kw)


def test_ray_tune_domains_are_read_as_they_are():
    from ray import tune as ray_tune

    found, constants = domains(
        {
            "lr": ray_tune.loguniform(1e-4, 1e-1),
            "drop": ray_tune.uniform(0.0, 0.5),
            "layers": ray_tune.randint(1, 4),
            "act": ray_tune.choice(["relu", "gelu"]),
            "epochs": 3,
        }
    )
    assert found["lr"] == tune.Domain("float", 1e-4, 1e-1, log=True)
    assert found["drop"] == tune.uniform(0.0, 0.5)
    assert found["layers"] == tune.randint(1, 4)
    assert found["act"].options == ("relu", "gelu")
    assert constants == {"epochs": 3}


def test_a_job_file_gives_the_config_the_space_and_the_run_arguments(tmp_path):
    from raymesh.tune.jobfile import load_study

    job = tmp_path / "study.toml"
    job.write_text(
        """
build = "tests.tune.helpers:quadratic"
steps = 4

[tune]
trials = 3
scheduler = "median"

[tune.space]
x = "uniform(0.0, 0.6)"
width = "choice([64, 128])"
name = "plain string"
"""
    )
    config, kwargs = load_study(job)
    assert config.steps == 4 and kwargs["trials"] == 3 and kwargs["scheduler"] == "median"
    assert kwargs["space"] == {
        "x": tune.uniform(0.0, 0.6),
        "width": tune.choice([64, 128]),
        "name": "plain string",
    }
    job.write_text('build = "m:f"\n[tune]\ntrials = 2\n[tune.space]\nx = "uniform(a, b)"\n')
    with pytest.raises(ValueError, match=r"tune.space.x = 'uniform\(a, b\)': the arguments"):
        load_study(job)
    job.write_text('build = "m:f"\n[tune]\ntrails = 2\n[tune.space]\nx = "uniform(0, 1)"\n')
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['trails'\]"):
        load_study(job)


def test_one_job_file_carries_the_model_through_training_a_study_and_serving(tmp_path):
    # Each command reads the training job (the top level) and its own table, and skips the
    # tables other commands own (raymesh._common.tables.TABLES). `raymesh tune` used to read
    # [serve] as a TrainConfig field: "TrainConfig: unknown field(s) ['serve']".
    from raymesh import train
    from raymesh.serve.jobfile import load_serving
    from raymesh.tune.jobfile import load_study

    job = tmp_path / "job.toml"
    job.write_text(
        """
build = "tests.tune.helpers:quadratic"
steps = 4

[checkpoint]
dir = "runs/quadratic"

[tune]
trials = 2

[tune.space]
x = "uniform(0.0, 0.6)"

[serve]
replicas = [1, 2]
port = 0
"""
    )
    config, kwargs = load_study(job)
    assert config.steps == 4 and config.checkpoint is not None and kwargs["trials"] == 2
    assert train.load_config(job).steps == 4
    model, served = load_serving(job)
    assert model["build"] == "tests.tune.helpers:quadratic" and served.replicas == (1, 2)
