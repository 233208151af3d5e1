"""`train.drive`: a job whose loop supplies each step's samples, on real procs. Fed the sample
order `fit` reads, it is `fit`, bit for bit; a rank SIGKILLed mid-step heals under the loop
(DDP in place at 4 ranks, FSDP from its checkpoint), with the weights of the run without the
kill; what the loop and the loss function report lands in the step's row and the run folder;
a checkpoint saved with the loop's data is what a second job resumes from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from raymesh import train
from raymesh.data import order
from raymesh.examples.mlp import SyntheticClassification
from raymesh.examples.mlp import build as mlp_build
from raymesh.testing import kill

from .weights import MLP, equal

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(300)]

G, STEPS = 48, 8
_DATA = SyntheticClassification()


def samples(step: int, seed: int = 0) -> list:
    """`fit`'s global batch of `step`, as samples."""
    return [_DATA[i] for i in order.global_batch(seed, step, G, len(_DATA))]


def with_accuracy(ctx: train.Context) -> train.Task:
    """The MLP task whose loss also reports the batch's accuracy."""
    task = mlp_build(ctx)

    def loss_fn(model, batch):
        x, y = batch
        logits = model(x)
        return F.cross_entropy(logits, y), {"accuracy": (logits.argmax(1) == y).float().mean()}

    task.loss_fn = loss_fn
    return task


def _config(**kw) -> train.TrainConfig:
    base = dict(workers=4, steps=STEPS, global_batch_size=G, seed=0)
    base.update(kw)
    return train.TrainConfig(**base)


def test_fed_fits_order_a_driven_job_is_fit_and_heals_a_kill_bitwise_at_4_ranks(fit, tmp_path):
    reference = fit(MLP, _config()).state_dict()
    config = _config(faults=[kill(rank=2, at_step=5)], run_dir=str(tmp_path / "run"))
    job = train.drive(MLP, config, example=samples(0), warm=fit.keywords["warm"])
    rows = []
    while job.trained < STEPS:
        rows.append(job.step(samples(job.trained), report={"reward_mean": job.trained / 10}))
    published = job.weights().get()
    with pytest.raises(ValueError, match=r"trained 8 of its steps=8, and 1 more would pass it"):
        job.step(samples(STEPS))
    result = job.close()
    with pytest.raises(RuntimeError, match="the job has ended"):
        job.step(samples(0))
    [failure] = result.failures
    assert (failure.rank, failure.step, failure.kind) == (2, 5, "died")
    assert failure.steps_recomputed == 1
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["reward_mean"] for r in rows] == [s / 10 for s in range(STEPS)]
    assert equal(reference, result.state_dict())
    assert equal(reference, published)
    # The run folder is fit's: one metrics line per step, with the loop's figures.
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["reward_mean"] for x in lines] == [s / 10 for s in range(STEPS)]
    states = [s for s, _ in result.transitions]
    assert states == ["Starting", "Running", "Healing", "Running", "Finishing", "Finished"]


def test_fsdp_heals_from_its_checkpoint_bitwise_and_a_save_carries_the_loops_data(
    fit, tmp_path, caplog
):
    def run(folder: Path, faults=()) -> tuple[train.Result, list[dict], Any]:
        ckpt = train.CheckpointConfig(dir=str(folder), every=2)
        config = _config(workers=2, strategy="fsdp", checkpoint=ckpt, faults=faults)
        with train.drive(with_accuracy, config, warm=warm) as job:
            rows = [job.step(samples(s)) for s in range(STEPS - 2)]
            job.save(extra={"position": [1, 2, 3]})
            rows += [job.step(samples(s)) for s in range(STEPS - 2, STEPS)]
            # What the job publishes: its ranks' shards, read while their procs live.
            published = job.weights()
            assert isinstance(published, train.ShardedState) and len(published.parts) == 2
            ctx = train.Context.alone(seed=9)
            model = mlp_build(ctx).model  # a reader's own copy (a generator's): loaded in place
            published.load_into(model)
            with pytest.raises(ValueError, match=r"keys this module lacks: \['blocks.0.0.weight'"):
                published.load_into(torch.nn.Linear(2, 2))
            read = (published.get(), model.state_dict())
        return job.close(), rows, read

    warm = fit.keywords["warm"]
    clean, rows, published = run(tmp_path / "clean")
    healed, _, _ = run(tmp_path / "healed", faults=[kill(rank=1, at_step=4)])
    assert [(f.rank, f.step, f.kind) for f in healed.failures] == [(1, 4, "died")]
    assert equal(clean.state_dict(), healed.state_dict())
    # Its ranks' shards, assembled where read, or copied into a reader's model: the weights.
    assert equal(clean.state_dict(), published[0])
    assert equal(clean.state_dict(), published[1])
    # The loss function's statistic: weighed as the loss, the mean over the batch
    assert all(0.0 <= r["accuracy"] <= 1.0 for r in rows)
    assert rows[-1]["accuracy"] > rows[0]["accuracy"]
    # The controller died after the loop's save at step 6: the next job resumes there, with
    # the loop's data, and ends with the weights of the run that went on.
    clean_dir = tmp_path / "clean"
    for step in (8,):
        for f in (clean_dir / f"step-{step:08d}").iterdir():
            f.unlink()
        (clean_dir / f"step-{step:08d}").rmdir()
    ckpt = train.CheckpointConfig(dir=str(clean_dir))
    config = _config(workers=2, strategy="fsdp", checkpoint=ckpt)
    caplog.clear()
    with train.drive(with_accuracy, config, warm=warm) as job:
        assert job.resumed == (STEPS - 2, {"position": [1, 2, 3]})
        while job.trained < STEPS:
            job.step(samples(job.trained))
    # Without periodic saves its samples are kept back to the last save: said once.
    said = [r.message for r in caplog.records if "keeps every step's samples" in r.message]
    assert len(said) == 1 and f"(step {STEPS - 2})" in said[0], said
    assert job.close().resumed_from == STEPS - 2
    assert equal(clean.state_dict(), job.close().state_dict())


def test_bad_input_to_a_driven_job_is_refused_before_procs_start():
    with pytest.raises(ValueError, match=r"example: 3 samples, but a step takes "):
        train.drive(MLP, _config(), example=samples(0)[:3])
    with pytest.raises(TypeError, match="give a list of samples, or columns"):
        train.drive(MLP, _config(), example=torch.zeros(G, 2))
    ragged = {"x": torch.zeros(G, 32), "y": torch.zeros(G - 1)}
    with pytest.raises(TypeError, match=r"as many rows each .*got x: \[48, 32\], y: \[47\]"):
        train.drive(MLP, _config(), example=ragged)
    with pytest.raises(ValueError, match=r"example: 3 samples, but a step takes "):
        train.drive(MLP, _config(), example={"x": torch.zeros(3, 32), "y": torch.zeros(3)})
    with pytest.raises(ValueError, match="a driven job's loop supplies them"):
        train.drive(MLP, _config(data=_pipeline()))


def _pipeline():
    from raymesh.data import Pipeline

    return Pipeline(source=list(range(10)))
