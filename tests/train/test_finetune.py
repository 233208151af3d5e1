"""Fine-tuning a Hugging Face model as users run it, on real procs: a Llama-architecture model
with a LoRA adapter (which trains, on a base that does not), bf16, activation checkpointing,
gradient clipping, a warmed-up cosine schedule and evaluation, healing a SIGKILLed rank bit for
bit as fp32 does; and an FSDP job in bf16 with checkpointing healing from its checkpoint to the
uninterrupted run's weights, bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

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


def _folder_key(name: str) -> str:
    """The name the base model's folder gives the PEFT model's weight `name`."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def test_a_lora_job_in_bf16_with_checkpointing_heals_a_sigkill_bit_for_bit(fit, files):
    from safetensors.torch import load_file

    clean = fit(None, _config(files))
    assert clean.decision.strategy == "ddp" and clean.decision.checkpointing
    assert "activation checkpointing per block" in clean.decision.reason
    evals = [h for h in clean.history if "eval_loss" in h]
    assert [h["step"] for h in evals] == [4, 8]
    assert all(math.isclose(h["perplexity"], math.exp(h["eval_loss"])) for h in evals)
    # The adapter trained: every lora_B left its initial zeros, and the held-out loss fell
    # (it would stay put to the bit with the adapter unchanged).
    state = clean.state_dict()
    lora_b = [k for k in state if ".lora_B." in k]
    assert len(lora_b) == 4, list(state)  # q_proj and v_proj of each of the 2 blocks
    assert all(state[k].count_nonzero() > 0 for k in lora_b), "a lora_B never trained"
    assert evals[1]["eval_loss"] < evals[0]["eval_loss"], evals
    # Only the adapter trains: every base weight is still the model folder's, bit for bit.
    folder = load_file(str(Path(files[0]) / "model.safetensors"))
    base = {_folder_key(k): v for k, v in state.items() if ".lora_" not in k}
    assert base.keys() == folder.keys(), (sorted(base), sorted(folder))
    moved = [k for k in base if not torch.equal(base[k], folder[k])]
    assert not moved, f"base weights that trained: {moved}"

    healed = fit(None, _config(files, faults=[kill(rank=1, at_step=3)]))
    [failure] = healed.failures
    assert (failure.rank, failure.step, failure.kind) == (1, 3, "died")
    assert equal(state, healed.state_dict())
    assert [h["eval_loss"] for h in healed.history if "eval_loss" in h] == [
        h["eval_loss"] for h in evals
    ]


def test_an_fsdp_job_in_bf16_with_checkpointing_heals_from_its_checkpoint(fit, files, tmp_path):
    def config(name: str, **kw) -> train.TrainConfig:
        return _config(
            files,
            strategy="fsdp",
            params={**_config(files).params, "lora_r": 0},  # a full fine-tune, sharded
            checkpoint=train.CheckpointConfig(dir=str(tmp_path / name), every=2),
            **kw,
        )

    clean = fit(None, config("clean"))
    result = fit(None, config("healed", faults=[kill(rank=0, at_step=5)]))
    assert result.decision.strategy == "fsdp" and result.decision.checkpointing
    [failure] = result.failures
    # Healed from the checkpoint of step 4: step 5, in flight, is recomputed.
    assert failure.kind == "died" and failure.steps_recomputed == 1, failure
    assert [h["step"] for h in result.history] == list(range(1, 9))
    assert math.isfinite(result.history[-1]["eval_loss"])
    # docs/training.md: FSDP heals from the newest checkpoint and ends bitwise equal to the
    # uninterrupted run (bf16 included: the same steps on the same samples, in the same order).
    assert equal(clean.state_dict(), result.state_dict())
    assert [h.get("eval_loss") for h in result.history] == [
        h.get("eval_loss") for h in clean.history
    ]
