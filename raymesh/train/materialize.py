"""A model built on the meta device, made real where it is used.

A model too large for one rank is built under `torch.device("meta")`: its parameters have
shapes and dtypes but no memory. The trainer shards it first (`fully_shard` works on meta
parameters), then allocates only this rank's shards on its device and fills them with the
task's `init_weights`, which reads only their slices of the pretrained weights (DCP), so no
rank ever holds the whole model (torchtitan's and FSDP2's recipe). Where a rank needs every
weight (DDP, a world of one, exporting, serving), the whole model is allocated and filled the
same way.

Only meta tensors are allocated: a real buffer (e.g. rotary frequencies, which are computed,
not saved) is moved to the device as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

__all__ = ["check_init", "materialize", "on_meta", "place", "repointed"]


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any of the model's parameters or buffers is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def check_init(
    model: torch.nn.Module, init_weights: Callable[[torch.nn.Module], None] | None
) -> None:
    """ValueError naming `Task.init_weights` when the model has meta tensors and nothing fills
    them."""
    if init_weights is None and on_meta(model):
        raise ValueError(
            "Task.init_weights=None: the model has tensors on the meta device and nothing to "
            "fill them; give init_weights (e.g. raymesh.train.hf.PretrainedWeights(folder)), "
            "or build the model on a real device"
        )


def place(model: torch.nn.Module, device: torch.device) -> None:
    """`model.to(device)` for its real tensors; meta ones stay meta (they have no data to move)."""
    model._apply(lambda t: t if t.is_meta else t.to(device))


def materialize(
    model: torch.nn.Module,
    device: torch.device,
    init_weights: Callable[[torch.nn.Module], None] | None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    params_on: torch.device | None = None,
) -> None:
    """Allocate the model's meta tensors on `device` (only the local shards of a sharded model:
    FSDP2 re-registers them) and fill them with `init_weights(model)`, under no_grad; its real
    tensors move to `device`. `params_on`: where the parameters are allocated instead (the
    CPU, for FSDP2's CPU offload, whose shards live in host memory; buffers stay on `device`,
    where the forward runs). The parameters are new objects afterwards: `optimizer`, when
    given, is re-pointed at them (`repointed`). ValueError naming `init_weights` when it is
    None and something is on meta."""
    if not on_meta(model):
        place(model, device)
        return
    check_init(model, init_weights)
    assert init_weights is not None
    buffers = {id(b) for b in model.buffers()}
    params_device = params_on or device

    def allocate(t: torch.Tensor) -> torch.Tensor:
        where = device if id(t) in buffers else params_device
        return torch.empty_like(t, device=where) if t.is_meta else t.to(where)

    with repointed(model, optimizer) if optimizer is not None else contextlib.nullcontext():
        model._apply(allocate)
    with torch.no_grad():
        init_weights(model)


@contextlib.contextmanager
def repointed(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within it the model's parameters may be replaced (sharded, materialized); on exit the
    optimizer's param groups hold the model's parameters of the same names (class, groups and
    hyperparameters unchanged). ValueError when the optimizer holds a parameter that is not
    the model's."""
    names = {id(p): n for n, p in model.named_parameters()}
    try:
        groups = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    except KeyError:
        raise ValueError(
            "the optimizer holds a parameter that is not in the model; build the optimizer "
            "from model.parameters() (raymesh re-points it at the sharded or materialized ones)"
        ) from None
    yield
    params = dict(model.named_parameters())
    for group, ns in zip(optimizer.param_groups, groups):
        group["params"] = [params[n] for n in ns]
