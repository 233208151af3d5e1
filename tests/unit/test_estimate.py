"""Unit tests for `raymesh.train.estimate`: the per-rank memory estimate, measured from a model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raymesh.train.estimate import (
    MemoryEstimate,
    cpu_budget_bytes,
    estimate,
    gpu_budget_bytes,
    largest_block_bytes,
    probe_activation_bytes,
)

GIB = 1 << 30
MIB = 1 << 20
FP32, BF16 = 4, 2  # bytes per element

# two_layers(), counted by hand from the layer sizes (weights + biases)
FIRST, SECOND = 10 * 20 + 20, 20 * 5 + 5  # 220 and 105
PARAMS = FIRST + SECOND  # 325, 1300 bytes in fp32


def two_layers() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 5))


class Blocks(nn.Module):
    """An embedding (root), three blocks of different sizes, and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)  # 400 params at the root
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 16), nn.Linear(16, 8)])
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight


# ---------------------------------------------------------------------------------------------
# estimate
# ---------------------------------------------------------------------------------------------


def test_estimate_counts_params_grads_and_two_adamw_states_per_param():
    model = two_layers()
    e = estimate(model, torch.optim.AdamW(model.parameters()), activation_bytes=1000)
    weights = PARAMS * FP32
    assert weights == 1300
    assert (e.param_bytes, e.grad_bytes, e.optimizer_bytes) == (weights, weights, 2 * weights)
    assert e.activation_bytes == 1000
    assert e.ddp_bytes() == 1300 + 1300 + 2600 + 1000


def test_estimate_counts_a_third_adam_state_with_amsgrad():
    model = two_layers()
    e = estimate(model, torch.optim.Adam(model.parameters(), amsgrad=True), 0)
    assert e.optimizer_bytes == 3 * PARAMS * FP32


def test_estimate_counts_one_sgd_state_with_momentum_and_none_without():
    model = two_layers()
    weights = PARAMS * FP32
    assert estimate(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 0) == (
        MemoryEstimate(weights, weights, weights, 0, largest_block_bytes=weights)
    )
    assert estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), 0).optimizer_bytes == 0


def test_estimate_reads_momentum_per_param_group():
    model = two_layers()
    opt = torch.optim.SGD(
        [
            {"params": model[0].parameters(), "momentum": 0.9},
            {"params": model[2].parameters()},
        ],
        lr=0.1,
    )
    assert estimate(model, opt, 0).optimizer_bytes == FIRST * FP32  # only the first has momentum


def test_estimate_assumes_two_states_for_an_unknown_optimizer():
    class Custom(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {})

    model = two_layers()
    assert estimate(model, Custom(model.parameters()), 0).optimizer_bytes == 2 * PARAMS * FP32


def test_estimate_counts_grads_of_trainable_params_only():
    model = two_layers()
    model[0].requires_grad_(False)
    e = estimate(model, torch.optim.AdamW(model[2].parameters()), 0)
    trainable = SECOND * FP32  # 420
    assert (e.param_bytes, e.grad_bytes, e.optimizer_bytes) == (
        PARAMS * FP32,
        trainable,
        2 * trainable,
    )


def test_estimate_uses_each_params_dtype_size():
    model = two_layers().to(torch.bfloat16)
    e = estimate(model, torch.optim.AdamW(model.parameters()), 0)
    weights = PARAMS * BF16  # 650
    assert (e.param_bytes, e.grad_bytes, e.optimizer_bytes) == (weights, weights, 2 * weights)


def test_estimate_counts_a_tied_weight_once():
    model = Blocks()
    n = 50 * 8 + (8 * 8 + 8) + (8 * 16 + 16) + (16 * 8 + 8)  # the head adds none: it is tied
    e = estimate(model, torch.optim.AdamW(model.parameters()), 0)
    assert e.param_bytes == FP32 * n
    assert e.optimizer_bytes == 2 * FP32 * n


def test_estimate_of_the_large_example_mlp_follows_from_its_layer_sizes():
    from raymesh.examples import mlp
    from raymesh.train.task import Context

    ctx = Context.alone()
    task = mlp.build_large(ctx)  # a 32-1024x4-4 MLP with AdamW
    hidden = 1024 * 1024 + 1024
    n = (32 * 1024 + 1024) + 3 * hidden + (1024 * 4 + 4)
    e = estimate(task.model, task.optimizer, 0)
    assert (e.param_bytes, e.grad_bytes, e.optimizer_bytes) == (
        FP32 * n,
        FP32 * n,
        2 * FP32 * n,  # AdamW: exp_avg and exp_avg_sq per parameter
    )
    assert e.largest_block_bytes == FP32 * hidden  # one hidden layer: the 4 MiB FSDP unit
    assert 12 * MIB < e.param_bytes < 12.5 * MIB  # "about 12.2 MiB of weights"


def test_estimate_rejects_negative_activation_bytes():
    model = two_layers()
    with pytest.raises(ValueError, match="activation_bytes=-1"):
        estimate(model, torch.optim.SGD(model.parameters(), lr=0.1), -1)


# ---------------------------------------------------------------------------------------------
# largest_block_bytes (the unit FSDP gathers at once)
# ---------------------------------------------------------------------------------------------


def test_largest_block_is_the_biggest_block_or_the_root_remainder():
    model = Blocks()
    assert largest_block_bytes(model) == FP32 * 50 * 8  # the tied embedding outweighs blocks
    model.emb, model.head = nn.Embedding(2, 8), nn.Linear(8, 2, bias=False)
    assert largest_block_bytes(model) == FP32 * (8 * 16 + 16)  # now the biggest block does


def test_largest_block_is_the_whole_model_without_a_module_list():
    assert largest_block_bytes(two_layers()) == PARAMS * FP32


# ---------------------------------------------------------------------------------------------
# MemoryEstimate
# ---------------------------------------------------------------------------------------------


def test_fsdp_bytes_shards_states_adds_one_block_and_keeps_activations_whole():
    e = MemoryEstimate(400, 400, 800, activation_bytes=100, largest_block_bytes=50)
    assert e.ddp_bytes() == 1700
    assert e.fsdp_bytes(4) == 1600 // 4 + 50 + 100
    assert e.fsdp_bytes(3) == 534 + 50 + 100  # the shard rounds up
    with pytest.raises(ValueError, match="world_size=0"):
        e.fsdp_bytes(0)


# ---------------------------------------------------------------------------------------------
# budgets
# ---------------------------------------------------------------------------------------------


def test_cpu_budget_is_the_configured_gib():
    assert cpu_budget_bytes(2.0) == 2 * GIB
    assert cpu_budget_bytes(0.5, ranks_per_host=4) == GIB // 2  # configured: already per rank


def _mem_total_bytes() -> int | None:
    """The host's MemTotal, read here from /proc/meminfo (None off Linux)."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return None
    number, unit = fields["MemTotal"].split()
    assert unit == "kB"
    return int(number) * 1024


def test_cpu_budget_defaults_to_host_memory_split_among_local_ranks():
    whole = _mem_total_bytes()
    if whole is None:  # not Linux: at least a plausible, evenly split figure
        whole = cpu_budget_bytes(None)
        assert whole > 64 * MIB
    assert cpu_budget_bytes(None) == whole
    assert cpu_budget_bytes(None, ranks_per_host=4) == whole // 4
    assert cpu_budget_bytes(None, ranks_per_host=3) == whole // 3


def test_cpu_budget_rejects_nonsense():
    with pytest.raises(ValueError, match="memory_budget_gb"):
        cpu_budget_bytes(0.0)
    with pytest.raises(ValueError, match="ranks_per_host"):
        cpu_budget_bytes(None, ranks_per_host=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_budget_is_the_devices_total_memory():
    assert gpu_budget_bytes(0) == torch.cuda.get_device_properties(0).total_memory


# ---------------------------------------------------------------------------------------------
# probe_activation_bytes
# ---------------------------------------------------------------------------------------------


def _sum_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(batch).sum()


def test_probe_counts_saved_activations_but_not_the_weights():
    model = nn.Sequential(nn.Linear(100, 100, bias=False), nn.Linear(100, 100, bias=False))
    # the input (for the first weight's grad) and the hidden (for the second's), 32x100 fp32 each
    assert probe_activation_bytes(model, _sum_loss, torch.randn(32, 100)) == 2 * 32 * 100 * 4


def test_probe_leaves_the_rng_and_buffers_as_it_found_them():
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5))
    batch = torch.randn(16, 8)
    before_buffers = {k: v.clone() for k, v in model.state_dict().items()}
    before_rng = torch.get_rng_state()
    assert probe_activation_bytes(model, _sum_loss, batch) > 0
    assert torch.equal(torch.get_rng_state(), before_rng)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before_buffers[k]), k


def test_the_probe_keeps_nothing_alive_after_it_returns():
    import weakref

    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 8))
    saved: list[weakref.ref] = []

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        hidden = m[1](m[0](x))  # tanh saves its own output: the tensor its grad_fn belongs to
        saved.append(weakref.ref(hidden))
        return m[2](hidden).sum()

    assert probe_activation_bytes(model, loss_fn, torch.randn(32, 64)) > 0
    assert saved[0]() is None  # returning the tensor itself from the pack hook kept it (a cycle)
