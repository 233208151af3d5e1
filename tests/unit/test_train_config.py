"""`TrainConfig` is written flat and read in sections (raymesh.train.sections): the same job
either way, every field checked once, by its section, under its own name."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from raymesh.testing import kill
from raymesh.train import TrainConfig, load_config
from raymesh.train.sections import (
    FailureConfig,
    LoopConfig,
    ParallelismConfig,
    ScalingConfig,
    StepConfig,
)


def test_the_sections_hold_every_field_once_and_nothing_else():
    names = [f.name for f in dataclasses.fields(TrainConfig)]
    sections = (ScalingConfig, ParallelismConfig, StepConfig, FailureConfig, LoopConfig)
    held = [f.name for s in sections for f in dataclasses.fields(s)] + ["checkpoint"]
    assert sorted(held) == sorted(names)


def test_a_flat_config_reads_the_same_in_sections_with_its_values_normalised():
    config = TrainConfig(
        workers=[2, 4],  # a TOML array
        global_batch_size=8,
        strategy="hsdp",
        shard_size=2,
        faults=["kill:rank=1:step=3"],
        max_failures=5,
        checkpoint={"dir": "runs/x", "every": 2},
    )
    assert config.workers == (2, 4) and config.scaling.workers == (2, 4)
    assert (config.scaling.min_workers, config.scaling.max_workers) == (2, 4)
    assert config.faults == (kill(rank=1, at_step=3),) == config.failure.faults
    assert config.parallelism.shard_size == 2 and config.failure.max_failures == 5
    assert config.loop.global_batch_size == 8 and config.checkpoint is not None


@pytest.mark.parametrize(
    ("field", "value", "fix"),
    [
        ("workers", 0, "give an integer >= 1"),
        ("spares", -1, "give an integer >= 0"),
        ("strategy", "zero", "use one of"),
        ("max_failures", 1.5, "give an integer >= 0"),
        ("step_timeout_s", 0, "seconds > 0"),
        ("steps", True, "give an integer >= 1"),
        ("seed", "7", "give an integer"),
        ("activation_bytes", -1, "give an integer >= 0"),
        ("precision", "int8", "use one of"),
        ("activation_checkpointing", "yes", "use 'auto', True or False"),
        ("offload", 1.0, "use 'auto', True or False"),
        ("grad_clip", 0, "give the largest gradient norm"),
        ("lr_schedule", "step", "use one of"),
        ("warmup_steps", -1, "give an integer >= 0"),
        ("eval_every", 0, "give an integer >= 1"),
    ],
)
def test_each_section_names_the_field_the_value_and_the_fix(field, value, fix):
    with pytest.raises(ValueError, match=f"^{field}={value!r}: .*{fix}"):
        TrainConfig(**{field: value})


def test_what_spans_sections_is_checked_by_the_config():
    with pytest.raises(ValueError, match=r"^global_batch_size=2: gives some of the 4 workers"):
        TrainConfig(workers=4, global_batch_size=2)
    with pytest.raises(ValueError, match=r"^shard_size=4: must split workers=4"):
        TrainConfig(workers=4, global_batch_size=4, shard_size=4)
    with pytest.raises(ValueError, match=r"^precision='fp16': with strategy='fsdp'.*'bf16'"):
        TrainConfig(precision="fp16", strategy="fsdp")
    with pytest.raises(ValueError, match="rank 2 does not exist with workers=2"):
        TrainConfig(workers=2, global_batch_size=2, faults=["kill:rank=2:step=1"])
    with pytest.raises(ValueError, match=r"^warmup_steps=5: is longer than the run \(steps=4\)"):
        TrainConfig(steps=4, warmup_steps=5)
    with pytest.raises(ValueError, match=r"^offload=True: .*strategy='ddp' does not shard"):
        TrainConfig(strategy="ddp", offload=True)


def test_a_flat_job_file_is_read_as_before(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text("workers = [1, 2]\nsteps = 3\nglobal_batch_size = 4\nspares = 1\n")
    config = load_config(job)
    assert config.scaling.spares == 1 and config.loop.steps == 3 and config.workers == (1, 2)
    # Its sections are built (and checked) once and kept; a replaced config has its own.
    assert config.step is config.step and config.scaling.workers == (1, 2)
    longer = dataclasses.replace(config, steps=6)
    assert longer.loop.steps == 6 and config.loop.steps == 3 and longer == longer
    assert pickle.loads(pickle.dumps(config)).loop == config.loop
    assert "_sections" not in config.to_dict()


def test_the_fine_tuning_example_is_a_valid_job_file():
    from pathlib import Path

    job = Path(__file__).resolve().parents[2] / "examples" / "finetune.toml"
    config = load_config(job, build=True)
    assert (config.precision, config.activation_checkpointing) == ("bf16", True)
    assert config.params["lora_r"] > 0 and config.eval_every


def test_fp16_on_cpu_ranks_is_refused_before_any_proc_starts():
    # gpus=False: the placer knows the ranks run on CPU without asking the cluster (no Ray)
    from raymesh import train

    config = TrainConfig(precision="fp16", gpus=False, global_batch_size=4, steps=1)
    with pytest.raises(ValueError, match=r"^precision='fp16': the ranks run on CPU .*'bf16'"):
        train.fit("raymesh.examples.mlp:build", config)
