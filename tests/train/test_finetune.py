"""Fine-tuning a Hugging Face model as users run it, on real procs: a Llama-architecture model
with a LoRA adapter, bf16, activation checkpointing, gradient clipping, a warmed-up cosine
schedule and evaluation, healing a SIGKILLed rank bit for bit as fp32 does; and an FSDP job
in bf16 with checkpointing healing from its checkpoint."""

from __future__ import annotations

import math

import pytest

from raymesh import train
from raymesh.testing import kill

from .hf_runs import text_file
from .weights import equal

pytestmark = [pytest.mark.usefixtures("ray_cluster"), pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from raymesh.train import hf

    root = tmp_path_factory.mktemp("finetune")
    model = hf.save_tiny_llama(root / "tiny", layers=2)
    return model, text_file(root)


def _config(files, **kw) -> train.TrainConfig:
    model, text = files
    base = dict(
        build="raymesh.train.hf:build",
        workers=2,
        steps=8,
        global_batch_size=8,
        report_every=2,
        precision="bf16",
        activation_checkpointing=True,
        grad_clip=1.0,
        lr_schedule="cosine",
        warmup_steps=2,
        eval_every=4,
        params={"model": str(model), "text": str(text), "block_size": 32, "lora_r": 4},
    )
    return train.TrainConfig(**{**base, **kw})


def test_a_lora_job_in_bf16_with_checkpointing_heals_a_sigkill_bit_for_bit(fit, files):
    clean = fit(None, _config(files))
    assert clean.decision.strategy == "ddp" and clean.decision.checkpointing
    assert "activation checkpointing per block" in clean.decision.reason
    evals = [h for h in clean.history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [4, 8]
    assert all(math.isclose(h["perplexity"], math.exp(h["eval_loss"])) for h in evals)
    # Only the adapter trains: the frozen base's weights are the model folder's.
    state = clean.state_dict()
    assert any("lora_A" in k for k in state)

    healed = fit(None, _config(files, faults=[kill(rank=1, at_step=3)]))
    [failure] = healed.failures
    assert (failure.rank, failure.step, failure.kind) == (1, 3, "died")
    assert equal(state, healed.state_dict())
    assert [h["eval_loss"] for h in healed.history if "eval_loss" in h] == [
        h["eval_loss"] for h in evals
    ]


def test_an_fsdp_job_in_bf16_with_checkpointing_heals_from_its_checkpoint(fit, files, tmp_path):
    config = _config(
        files,
        strategy="fsdp",
        params={**_config(files).params, "lora_r": 0},  # a full fine-tune, sharded
        checkpoint=train.CheckpointConfig(dir=str(tmp_path / "ckpt"), every=2),
        faults=[kill(rank=0, at_step=5)],
    )
    result = fit(None, config)
    assert result.decision.strategy == "fsdp" and result.decision.checkpointing
    [failure] = result.failures
    assert failure.kind == "died" and failure.steps_recomputed is not None
    assert [h["step"] for h in result.history] == list(range(1, 9))
    assert math.isfinite(result.history[-1]["eval_loss"])
