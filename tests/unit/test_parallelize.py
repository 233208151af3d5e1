"""Unit tests for `raymesh.train.rank.parallelize`: a decision applied for real, on one gloo rank.

A process group of one (rank 0 of 1, over an in-memory HashStore) runs the same DDP and FSDP2
code as a real job, without Ray and without a second process; reductions over one rank leave
the gradients as they are, so the wrapped model must train bit for bit like the plain one.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from raymesh.train.estimate import MemoryEstimate, fsdp_blocks
from raymesh.train.rank.parallelize import no_sync, parallelize
from raymesh.train.strategy import StrategyDecision

# The first FSDP test imports FSDP2 and DTensor (about 1 s); every test here takes well under 5 s.
pytestmark = pytest.mark.timeout(30)

CPU = torch.device("cpu")


class Blocks(nn.Module):
    """Two blocks in a ModuleList (FSDP's units) and a head at the root."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 4)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x)


def decision(strategy: str, shard_size: int | None = None) -> StrategyDecision:
    return StrategyDecision(
        strategy=strategy,  # type: ignore[arg-type]
        reason="chosen by the test",
        estimate=MemoryEstimate(0, 0, 0, 0),
        budget_bytes=1,
        shard_size=shard_size,
    )


# The three decisions, all valid for a world of one: HSDP's mesh is then 1 replica x 1 shard.
DECISIONS = {"ddp": decision("ddp"), "fsdp": decision("fsdp"), "hsdp": decision("hsdp", 1)}


@pytest.fixture
def group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def built(seed: int = 0) -> tuple[Blocks, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Blocks()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    options = StateDictOptions(full_state_dict=True)
    state = get_model_state_dict(model, options=options)
    return {k: v.detach() for k, v in state.items() if isinstance(v, torch.Tensor)}


def test_fsdp_blocks_are_the_children_of_the_first_module_list():
    model = Blocks()
    assert fsdp_blocks(model) == list(model.blocks)
    assert fsdp_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


def test_ddp_returns_a_distributed_data_parallel_and_leaves_the_optimizer_alone(group):
    model, opt = built()
    params = list(model.parameters())
    wrapped = parallelize(model, DECISIONS["ddp"], world_size=1, device=CPU, optimizer=opt)
    assert isinstance(wrapped, nn.parallel.DistributedDataParallel)
    assert wrapped.module is model
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], params, strict=True))


@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_sharding_happens_in_place_and_repoints_the_optimizer_at_the_new_parameters(
    group, strategy
):
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.SGD(
        [
            {"params": model.blocks.parameters(), "lr": 0.1},
            {"params": model.head.parameters(), "lr": 0.01, "momentum": 0.9},
        ],
        lr=1.0,
    )
    model(torch.randn(2, 4)).sum().backward()
    opt.step()  # leaves momentum state, keyed by the parameters fully_shard replaces
    assert opt.state

    wrapped = parallelize(model, DECISIONS[strategy], world_size=1, device=CPU, optimizer=opt)

    assert wrapped is model
    blocks, head = opt.param_groups
    assert all(a is b for a, b in zip(blocks["params"], model.blocks.parameters(), strict=True))
    assert all(a is b for a, b in zip(head["params"], model.head.parameters(), strict=True))
    assert (blocks["lr"], head["lr"], head["momentum"]) == (0.1, 0.01, 0.9)
    assert type(opt) is torch.optim.SGD and not opt.state
    param = next(model.parameters())
    assert isinstance(param, DTensor)
    assert param.device_mesh.mesh_dim_names == (
        ("replicate", "shard") if strategy == "hsdp" else None
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hsdp"])
def test_an_accumulated_step_trains_bit_for_bit_like_the_plain_model(group, strategy):
    plain, plain_opt = built()
    model, opt = built()
    wrapped = parallelize(model, DECISIONS[strategy], world_size=1, device=CPU, optimizer=opt)
    torch.manual_seed(1)
    micro = [torch.randn(3, 4), torch.randn(5, 4)]
    for _ in range(2):  # the second step also uses the momentum the first left
        for i, x in enumerate(micro):
            with no_sync(wrapped, i < len(micro) - 1):
                wrapped(x).square().mean().backward()
            plain(x).square().mean().backward()
        opt.step()
        plain_opt.step()
        opt.zero_grad()
        plain_opt.zero_grad()
    reference = plain.state_dict()
    for name, value in full_state(wrapped).items():
        assert torch.equal(value, reference[name]), name


def test_ddp_no_sync_skips_the_all_reduce_until_the_last_micro_batch(group):
    model, opt = built()
    wrapped = parallelize(model, DECISIONS["ddp"], world_size=1, device=CPU, optimizer=opt)
    reductions = []

    # Not annotated: DDP rejects a hook whose `bucket` annotation is not the GradBucket class
    # itself, and this module's annotations are strings.
    def count(state, bucket):  # a reduction that counts its buckets and leaves them as they are
        reductions.append(bucket.index())
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(bucket.buffer())
        return done

    assert isinstance(wrapped, nn.parallel.DistributedDataParallel)
    wrapped.register_comm_hook(None, count)
    with no_sync(wrapped, True):
        wrapped(torch.randn(2, 4)).sum().backward()
    assert reductions == []
    with no_sync(wrapped, False):
        wrapped(torch.randn(2, 4)).sum().backward()
    assert reductions


def test_fsdp_no_sync_holds_gradients_back_and_restores_sync_even_after_an_error(group):
    model, opt = built()
    wrapped = parallelize(model, DECISIONS["fsdp"], world_size=1, device=CPU, optimizer=opt)
    with no_sync(wrapped, True):
        wrapped(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is None for p in model.parameters())  # no reduce-scatter yet
    with pytest.raises(RuntimeError, match="a step failed"), no_sync(wrapped, True):
        raise RuntimeError("a step failed")
    wrapped(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_no_sync_of_a_plain_module_accumulates_locally():
    model = Blocks()  # a world of one: the trainer trains the module itself
    with no_sync(model, True):
        model(torch.randn(2, 4)).sum().backward()
    first = [p.grad.clone() for p in model.parameters()]
    with no_sync(model, False):
        model(torch.randn(2, 4)).sum().backward()
    assert all(not torch.equal(a, p.grad) for a, p in zip(first, model.parameters()))


def test_parallelize_needs_a_process_group_of_the_given_size(group):
    model, opt = built()
    with pytest.raises(ValueError, match="world_size=2 but the process group has 1 ranks"):
        parallelize(model, DECISIONS["ddp"], world_size=2, device=CPU, optimizer=opt)


def test_parallelize_without_a_process_group_names_the_fix():
    model, opt = built()
    with pytest.raises(ValueError, match=r"no process group; call dist\.init_process_group"):
        parallelize(model, DECISIONS["fsdp"], world_size=1, device=CPU, optimizer=opt)


def test_sharding_refuses_an_optimizer_over_parameters_outside_the_model(group):
    model, _ = built()
    stranger = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model.parameters(), stranger], lr=0.1)
    with pytest.raises(ValueError, match="a parameter that is not in the model"):
        parallelize(model, DECISIONS["fsdp"], world_size=1, device=CPU, optimizer=opt)
