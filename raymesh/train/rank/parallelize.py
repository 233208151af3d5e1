"""Applying a strategy decision to a model: DDP, FSDP2 or HSDP, in a fixed order.

The third of decide, estimate, apply (torchtitan's parallelize.py): `raymesh.train.strategy`
decides from numbers alone, and this module carries a `StrategyDecision` out on one rank's
model for the current process group. It makes no choices of its own: what it wraps, and how,
follows from the decision, so a decision tested without a model is the one applied here.

- DDP: `DistributedDataParallel(model)`, on the rank's GPU when it has one.
- FSDP: `fully_shard` on each of `fsdp_blocks(model)`, then on the root, over every rank.
- HSDP: the same over the decision's (replicate, shard) device mesh: gradients are
  reduce-scattered within a shard group and all-reduced across replicas.
- Activation checkpointing (`decision.checkpointing`): each block's forward runs under
  `torch.utils.checkpoint` (non-reentrant), before any wrapping, as torchtitan applies it.
- Mixed precision (`precision`): FSDP2's `MixedPrecisionPolicy` (parameters gathered in
  bf16/fp16, gradients reduced in fp32); under DDP the step's autocast does it
  (`autocast_dtype`). Master weights and optimizer state stay fp32 either way.
- Offload (`decision.offload`): FSDP2's `CPUOffloadPolicy`: shards, gradients and optimizer
  state in pinned host memory, copied to the GPU per block.
- A model built on the meta device (`raymesh.train.materialize`) is allocated and filled by
  `init_weights` after sharding, so each rank allocates and reads only its shards; under DDP
  before wrapping (every rank holds a replica).

The units are `raymesh.train.estimate.fsdp_blocks`, the same the memory estimate counts as
FSDP's largest unit, so the estimate and the wrapping agree on what is gathered at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from raymesh.train.estimate import fsdp_blocks
from raymesh.train.materialize import materialize, on_meta, repointed
from raymesh.train.strategy import StrategyDecision

__all__ = ["autocast_dtype", "no_sync", "parallelize", "set_checkpointing", "settle_buckets"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype a step's compute runs in for `precision` ("fp32": None, no autocast)."""
    return _DTYPES[precision]


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Checkpoint each of `fsdp_blocks(model)` (or stop): the block's forward runs under
    non-reentrant `torch.utils.checkpoint`, which keeps only its inputs and recomputes the rest
    in the backward. The module tree, its parameter names and so its state dict are unchanged
    (the forward is replaced on the instance), so checkpoints load with it on or off. The
    recompute draws the same random numbers as the forward (checkpoint restores the RNG
    state), so a step is the same with it on or off up to the order of float operations."""
    for block in fsdp_blocks(model):
        state = block.__dict__  # instance attributes: nn.Module's own __setattr__ is not needed
        if on and "_raymesh_forward" not in state:
            state["_raymesh_forward"] = forward = block.forward
            state["forward"] = _checkpointed(forward)
        elif not on and "_raymesh_forward" in state:
            saved = state.pop("_raymesh_forward")
            del state["forward"]
            if getattr(saved, "__func__", None) is not getattr(type(block), "forward", None):
                state["forward"] = saved  # it was the instance's own before


def _checkpointed(forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():  # evaluation: nothing to recompute
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def parallelize(
    model: torch.nn.Module,
    decision: StrategyDecision,
    *,
    world_size: int,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    precision: str = "fp32",
    ddp_timings: bool = False,
    init_weights: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """Wrap `model` (already on `device`) for the current process group as `decision` says,
    and return the module to train. COLLECTIVE: every rank of the group calls it, with its own
    model built the same way.

    DDP: returns a `DistributedDataParallel` around `model` (`device_ids=[device.index]` on
    CUDA); its constructor broadcasts rank 0's parameters and buffers to every rank. `model`'s
    parameters stay the same objects, so `optimizer` is left as it is. `ddp_timings`: DDP
    records its forward and backward compute time on every step, for `_get_ddp_logging_data()`
    (load balancing reads it); by default it records the first 10 steps, then every 100th.

    FSDP and HSDP: shards `model` in place (`fully_shard` per block of `fsdp_blocks`, then the
    root; HSDP over a `decision.mesh(world_size)` device mesh with axes ("replicate", "shard"))
    and returns `model` itself. `fully_shard` replaces every parameter with a sharded one, so
    `optimizer`'s param groups are re-pointed at the new parameters by name (class, groups and
    hyperparameters unchanged) and its state is cleared (it referred to the old ones).

    A model with tensors on the meta device is materialized (`materialize`, with
    `init_weights`): under FSDP/HSDP after sharding, so only this rank's shards are allocated
    and filled; under DDP before wrapping. The optimizer is re-pointed at the new parameters.

    Raises ValueError when no process group of `world_size` ranks is initialised, when HSDP's
    shard groups do not divide `world_size` (see `StrategyDecision.mesh`), or, sharded, when
    `optimizer` holds a parameter that is not one of `model`'s.
    """
    if not dist.is_initialized():
        raise ValueError("parallelize: no process group; call dist.init_process_group first")
    if dist.get_world_size() != world_size:
        raise ValueError(
            f"parallelize: world_size={world_size} but the process group has "
            f"{dist.get_world_size()} ranks; pass the group's size"
        )
    set_checkpointing(model, decision.checkpointing)
    meta = on_meta(model)
    if not decision.sharded:
        if meta:
            materialize(model, device, init_weights, optimizer)
        ids = [device.index] if device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
        if ddp_timings:
            ddp._set_ddp_runtime_logging_sample_rate(1)
        return ddp

    mesh = None  # FSDP: every rank, one dimension
    dims = decision.mesh(world_size)
    if dims is not None:  # HSDP: reduce-scatter within a shard group, then all-reduce
        mesh = init_device_mesh(device.type, dims, mesh_dim_names=("replicate", "shard"))
    dtype = autocast_dtype(precision)
    policies: dict[str, Any] = {}
    if dtype is not None:  # gathered in `dtype`, reduced in fp32, master weights fp32
        policies["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if decision.offload:
        policies["offload_policy"] = CPUOffloadPolicy()
    # Names, not objects: fully_shard replaces the parameters, keeping their names.
    with repointed(model, optimizer):
        for unit in fsdp_blocks(model):
            fully_shard(unit, mesh=mesh, **policies)
        fully_shard(model, mesh=mesh, **policies)
        if meta:  # offloaded shards live in host memory from the start, as FSDP2 keeps them
            params_on = torch.device("cpu") if decision.offload else None
            materialize(model, device, init_weights, params_on=params_on)
    optimizer.state.clear()
    return model


def settle_buckets(model: torch.nn.Module, backward: Callable[[], torch.Tensor]) -> None:
    """Lay out a new DDP's gradient buckets as a DDP that has trained already has them.
    COLLECTIVE, like a training step; leaves gradients None and parameters unchanged (buffers
    may change: load the state after it).

    DDP reduces its first backward in one bucket of the parameters in reverse order, then
    rebuilds its buckets in the order the gradients became ready. Where an element sits in a
    bucket decides which chunk of gloo's ring all-reduce it falls in, and so the order in which
    the ranks' values are summed; with three or more ranks that order changes the sum's last
    bits. A world re-formed after a failure builds a new DDP: without this, its first step
    would reduce in the initial layout where the uninterrupted run used the rebuilt one, and
    the healed run would drift from it (27 tensors of TinyGPT differ after 60 more steps on 4
    ranks). `backward` runs one forward and backward through `model` (a batch of the next
    step: any batch gives the same order of readiness); the rebuild itself happens at the
    next forward, as in the uninterrupted run."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    backward().backward()
    model.zero_grad(set_to_none=True)


def no_sync(model: torch.nn.Module, skip: bool) -> contextlib.AbstractContextManager[Any]:
    """Gradient accumulation: within the returned context, while `skip`, backward passes
    accumulate gradients locally with no reduction across ranks; the first backward outside
    it (or with `skip` False) reduces everything accumulated. `model` is what `parallelize`
    returned: DDP uses its `no_sync()`; FSDP and HSDP (FSDP2) turn `set_requires_gradient_sync`
    off for the context and back on when it exits, also on an exception. A plain module (a
    world of one rank, which the trainer does not wrap) reduces nothing: a null context."""
    if not skip:
        return contextlib.nullcontext()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        return _without_gradient_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _without_gradient_sync(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
