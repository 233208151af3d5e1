"""The step's fine-tuning features on one process: the learning-rate schedule, activation
checkpointing per block (same numbers, same state dict, less saved), and evaluation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from raymesh.train.estimate import checkpointed_activations, fsdp_blocks, probe_activation_bytes
from raymesh.train.rank.evaluate import evaluate
from raymesh.train.rank.parallelize import set_checkpointing
from raymesh.train.rank.step import Precision, lr_factor

CPU = torch.device("cpu")


def test_the_schedule_warms_up_linearly_then_holds_or_decays_to_zero():
    assert [lr_factor("constant", 4, s, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1, 1, 1]
    assert lr_factor("linear", 0, 0, 10) == 1.0 and lr_factor("linear", 0, 5, 10) == 0.5
    assert lr_factor("cosine", 2, 2, 12) == 1.0
    assert lr_factor("cosine", 2, 7, 12) == pytest.approx(0.5)
    assert lr_factor("cosine", 0, 10, 10) == pytest.approx(0.0, abs=1e-12)


class Stack(nn.Module):
    def __init__(self, blocks: int = 4, width: int = 32) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(blocks)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).pow(2).mean()


def test_checkpointing_keeps_the_gradients_and_the_state_dict_and_saves_less():
    torch.manual_seed(0)
    model, x = Stack(), torch.randn(64, 32)
    names = list(model.state_dict())
    _loss(model, x).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    full = probe_activation_bytes(model, _loss, x)
    model.zero_grad()
    set_checkpointing(model, True)
    assert list(model.state_dict()) == names  # checkpoints load with it on or off
    _loss(model, x).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, model.parameters()))
    probed = probe_activation_bytes(model, _loss, x, inputs_of=fsdp_blocks(model))
    with_ac = checkpointed_activations(full, probed, len(model.blocks))
    # Each block keeps its input (8 KiB) instead of its 3 hidden activations (96 KiB).
    assert with_ac < full / 2, (full, probed, with_ac)
    set_checkpointing(model, False)
    assert "_raymesh_forward" not in model.blocks[0].__dict__
    assert "forward" not in model.blocks[0].__dict__  # the class's forward again


def test_evaluation_is_the_sample_weighted_mean_over_the_whole_set():
    torch.manual_seed(0)
    model, data = Stack(blocks=1), torch.randn(10, 32)
    model.train()
    got = evaluate(
        model,
        _loss,
        lambda idx: data[idx],
        len(data),
        rank=0,
        world_size=1,
        batch_size=4,  # batches of 4, 4, 2: a plain mean of batch means would weigh 2 as 4
        device=CPU,
        precision=Precision(),
    )
    with torch.no_grad():
        want = float(model(data).pow(2).mean())
    assert math.isclose(got, want, rel_tol=1e-6)
    assert model.training  # left as found


def test_the_probe_of_one_sample_times_the_batch_is_the_whole_batchs_activations():
    from raymesh.train.rank.measure import one_sample

    torch.manual_seed(0)
    model, x = Stack(), torch.randn(16, 32)
    one, n = one_sample({"x": [x], "meta": "kept"})
    assert n == 16 and one["x"][0].shape == (1, 32) and one["meta"] == "kept"
    whole = probe_activation_bytes(model, _loss, x)
    scaled = n * probe_activation_bytes(model, _loss, one_sample(x)[0])
    assert abs(scaled - whole) <= 0.05 * whole, (scaled, whole)
    # Tensors of different first sizes: not a batch of samples, measured whole.
    assert one_sample((x, torch.zeros(3)))[1] == 1
