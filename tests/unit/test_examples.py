"""Unit tests for `raymesh.examples`: the models, the datasets and the build functions, in one
process (no Ray, no torch.distributed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from raymesh.examples import mlp, tinygpt
from raymesh.train.task import Context, Task

CTX = Context.alone()


def small_gpt() -> tinygpt.TinyGPT:
    return tinygpt.TinyGPT(block_size=16, n_layer=2, n_head=2, n_embd=32)


def train(task: Task, batches: list, steps: int) -> list[float]:
    """Single-process steps over `batches`, cycled; the loss before each step."""
    losses = []
    for step in range(steps):
        loss = task.loss_fn(task.model, batches[step % len(batches)])
        task.optimizer.zero_grad()
        loss.backward()
        task.optimizer.step()
        losses.append(loss.item())
    return losses


def batches_of(dataset, batch_size: int, n: int, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(dataset), generator=g)[: batch_size * n].tolist()
    collate = torch.utils.data.default_collate
    return [
        collate([dataset[i] for i in idx[k : k + batch_size]])
        for k in range(0, len(idx), batch_size)
    ]


# ---------------------------------------------------------------------------------------------
# TinyGPT
# ---------------------------------------------------------------------------------------------


def test_tinygpt_gives_logits_over_256_bytes_at_every_position():
    model = small_gpt()
    idx = torch.randint(0, 256, (3, 16))
    assert model(idx).shape == (3, 16, 256)
    assert model(idx[:, :5]).shape == (3, 5, 256)


def test_tinygpt_is_causal_future_tokens_do_not_change_earlier_logits():
    model = small_gpt().eval()
    idx = torch.randint(0, 256, (2, 16))
    changed = idx.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_tinygpt_ties_the_lm_head_to_the_token_embedding_and_exposes_blocks():
    model = small_gpt()
    assert model.lm_head.weight is model.tok_emb.weight
    assert isinstance(model.blocks, nn.ModuleList) and len(model.blocks) == 2


def _linear(n_in: int, n_out: int, bias: bool = True) -> int:
    """Parameters of an n_in -> n_out linear layer, counted by hand."""
    return n_in * n_out + (n_out if bias else 0)


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())  # a tied tensor once


def test_tinygpt_default_config_has_120576_parameters():
    model = tinygpt.TinyGPT()
    assert (model.block_size, len(model.blocks)) == (64, 2)
    assert model.tok_emb.weight.shape == (256, 64)  # a byte vocabulary, 64 wide
    # By hand from the layer sizes: two LayerNorms (weight and bias), the attention's qkv and
    # output projections, and the 4x-wide MLP.
    width = 64
    block = 2 * (2 * width) + _linear(width, 3 * width) + _linear(width, width)
    block += _linear(width, 4 * width) + _linear(4 * width, width)
    assert block == 49_984
    embeddings = 256 * width + 64 * width  # tokens, positions; the lm head is the token table
    total = embeddings + 2 * block + 2 * width  # + the final LayerNorm
    assert total == 120_576  # the "~0.12M parameters" the module names
    assert _count(model.blocks[0]) == block
    assert _count(model) == total


def test_tinygpt_rejects_a_sequence_longer_than_its_block_size():
    with pytest.raises(ValueError, match="block_size=16"):
        small_gpt()(torch.zeros(1, 17, dtype=torch.long))


def test_tinygpt_rejects_heads_that_do_not_divide_the_width():
    with pytest.raises(ValueError, match="n_head=3"):
        tinygpt.TinyGPT(n_embd=32, n_head=3)


def test_tinygpt_init_follows_the_global_seed():
    torch.manual_seed(0)
    a = small_gpt().state_dict()
    torch.manual_seed(0)
    b = small_gpt().state_dict()
    torch.manual_seed(1)
    c = small_gpt().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_emb.weight"], c["tok_emb.weight"])


# ---------------------------------------------------------------------------------------------
# CharDataset
# ---------------------------------------------------------------------------------------------


def test_char_dataset_is_stdlib_bytes_with_targets_shifted_by_one():
    ds = tinygpt.CharDataset(block_size=32, max_bytes=64 * 1024)
    assert len(ds) == (64 * 1024 - 33) // 32 + 1
    for i in (0, 1, len(ds) // 2, len(ds) - 1, -1):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.long
        assert x.shape == y.shape == (32,)
        assert int(x.min()) >= 0 and int(x.max()) <= 255
        assert torch.equal(x[1:], y[:-1])
    assert torch.equal(ds[1][0][0:1], ds[0][1][-1:])  # windows tile the corpus
    assert b"def " in tinygpt.stdlib_corpus(64 * 1024)


def test_char_dataset_is_deterministic():
    a = tinygpt.CharDataset(block_size=16, max_bytes=32 * 1024)
    tinygpt.stdlib_corpus.cache_clear()  # read the files again, not the cached bytes
    b = tinygpt.CharDataset(block_size=16, max_bytes=32 * 1024)
    assert a.digest == b.digest and len(a) == len(b)
    assert torch.equal(a.data, b.data)


def test_char_dataset_stride_sets_the_window_spacing():
    ds = tinygpt.CharDataset(block_size=16, max_bytes=4096, stride=4)
    assert len(ds) == (4096 - 17) // 4 + 1
    assert torch.equal(ds[1][0][:12], ds[0][0][4:])


def test_char_dataset_raises_index_error_past_the_end():
    ds = tinygpt.CharDataset(block_size=16, max_bytes=4096)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_char_dataset_names_the_fix_when_the_corpus_is_too_small():
    with pytest.raises(ValueError, match="raise max_bytes"):
        tinygpt.CharDataset(block_size=64, max_bytes=10)


# ---------------------------------------------------------------------------------------------
# training and sampling
# ---------------------------------------------------------------------------------------------


def test_thirty_adamw_steps_reduce_the_tinygpt_loss():
    torch.manual_seed(0)
    task = tinygpt.build(CTX)
    batches = batches_of(task.dataset, batch_size=8, n=4)
    losses = train(task, batches, steps=30)
    assert losses[0] > 5.0  # ~ln(256) = 5.55 at init
    assert sum(losses[-4:]) / 4 < losses[0] - 1.5, losses


def test_generate_extends_the_prompt_greedily_and_deterministically():
    torch.manual_seed(0)
    model = small_gpt()
    model.train()
    out = tinygpt.generate(model, b"def f(x):", 20)
    assert out.startswith(b"def f(x):") and len(out) == 9 + 20
    assert out == tinygpt.generate(model, b"def f(x):", 20)
    assert model.training  # restored
    long = tinygpt.generate(model, b"x" * 30, 5)  # prompts longer than block_size are cropped
    assert len(long) == 35


def test_generate_samples_reproducibly_with_a_seeded_generator():
    torch.manual_seed(0)
    model = small_gpt()

    def sample(seed: int) -> bytes:
        return tinygpt.generate(
            model, b"", 30, temperature=1.0, generator=torch.Generator().manual_seed(seed)
        )

    assert sample(0) == sample(0)
    assert len(sample(0)) == 1 + 30  # an empty prompt starts from a newline
    assert sample(0) != sample(1)


# ---------------------------------------------------------------------------------------------
# MLP examples
# ---------------------------------------------------------------------------------------------


def test_synthetic_classification_is_deterministic_and_uses_every_class():
    a, b = mlp.SyntheticClassification(seed=0), mlp.SyntheticClassification(seed=0)
    assert len(a) == 2048
    assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y)
    assert not torch.equal(a.y, mlp.SyntheticClassification(seed=1).y)
    x, y = a[0]
    assert x.shape == (32,) and y.dtype == torch.long
    assert torch.bincount(a.y, minlength=4).min() > 2048 // 16  # no class is negligible


def test_datasets_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    mlp.SyntheticClassification()
    mlp.SyntheticMNIST(n=64)
    tinygpt.CharDataset(block_size=16, max_bytes=4096)
    assert torch.equal(torch.get_rng_state(), state)


def test_build_is_the_32_64_4_mlp_with_adamw():
    task = mlp.build(CTX)
    assert isinstance(task.model, mlp.MLP) and len(task.model.blocks) == 1
    assert _count(task.model) == _linear(32, 64) + _linear(64, 4) == 2372
    assert isinstance(task.optimizer, torch.optim.AdamW)


def test_the_small_mlp_learns_the_teacher():
    torch.manual_seed(0)
    task = mlp.build(CTX)
    batches = batches_of(task.dataset, batch_size=256, n=8)
    losses = train(task, batches, steps=100)
    assert losses[-1] < 0.6 * losses[0], losses[::10]


def test_build_large_has_one_fsdp_unit_per_hidden_layer():
    task = mlp.build_large(CTX)
    assert isinstance(task.model, mlp.MLP) and len(task.model.blocks) == 4
    # 32 -> 1024, three 1024 -> 1024, 1024 -> 4
    expected = _linear(32, 1024) + 3 * _linear(1024, 1024) + _linear(1024, 4)
    assert expected == 3_186_692  # the figure build_large's docstring gives
    assert _count(task.model) == expected
    assert [_count(block) for block in task.model.blocks] == [_linear(32, 1024)] + [
        _linear(1024, 1024)
    ] * 3  # each FSDP unit one hidden layer
    assert isinstance(task.optimizer, torch.optim.AdamW)


def test_build_bench_is_the_784_1024_1024_10_mlp_with_sgd():
    task = mlp.build_bench(CTX)
    assert isinstance(task.model, mlp.MLP784)
    expected = _linear(784, 1024) + _linear(1024, 1024) + _linear(1024, 10)
    assert expected == 1_863_690  # the figure MLP784's docstring gives
    assert _count(task.model) == expected
    assert [tuple(p.shape) for p in task.model.parameters()] == [
        (1024, 784),
        (1024,),
        (1024, 1024),
        (1024,),
        (10, 1024),
        (10,),
    ]
    assert isinstance(task.optimizer, torch.optim.SGD)
    x, y = task.dataset[0]
    assert x.shape == (784,) and 0 <= int(y) < 10
    batch = torch.utils.data.default_collate([task.dataset[i] for i in range(64)])
    assert task.loss_fn(task.model, batch).shape == ()


# ---------------------------------------------------------------------------------------------
# every build function
# ---------------------------------------------------------------------------------------------

BUILDS = [tinygpt.build, mlp.build, mlp.build_large, mlp.build_bench]


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: f"{b.__module__}.{b.__name__}")
def test_build_returns_a_task_whose_loss_is_a_differentiable_scalar(build):
    task = build(CTX)
    assert isinstance(task, Task)
    assert isinstance(task.model, nn.Module)
    assert len(task.dataset) > 0
    opt_params = {id(p) for g in task.optimizer.param_groups for p in g["params"]}
    assert opt_params == {id(p) for p in task.model.parameters()}
    batch = torch.utils.data.default_collate([task.dataset[i] for i in range(4)])
    loss = task.loss_fn(task.model, batch)
    assert loss.shape == () and loss.requires_grad and torch.isfinite(loss)


@pytest.mark.parametrize("build", BUILDS, ids=lambda b: f"{b.__module__}.{b.__name__}")
def test_build_follows_the_frameworks_seed_instead_of_reseeding(build):
    def weights(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return nn.utils.parameters_to_vector(build(CTX).model.parameters())

    assert torch.equal(weights(0), weights(0))
    assert not torch.equal(weights(0), weights(1))


def test_local_ranks_count_each_hosts_ranks_in_global_rank_order():
    from raymesh.train.task import Local, local_ranks

    assert local_ranks(["a", "a", "b", "a", "b"]) == [
        Local(0, 3),
        Local(1, 3),
        Local(0, 2),
        Local(2, 3),
        Local(1, 2),
    ]
    assert local_ranks(["a"]) == [Local(0, 1)]
