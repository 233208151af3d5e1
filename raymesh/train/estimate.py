"""The per-rank memory estimate: what one rank of a job holds, measured from its model.

This is the part of the strategy choice that needs the model (torchtitan keeps it apart in the
same way): `estimate()` adds up what one rank holds unsharded (parameters, gradients, optimizer
state, activations) and `probe_activation_bytes()` measures the activations with one forward
pass; `cpu_budget_bytes()` / `gpu_budget_bytes()` say how much a rank may use. Each rank runs
these after its build function; the controller hands the resulting `MemoryEstimate` to
`raymesh.train.strategy` (the decision, pure arithmetic), and `raymesh.train.rank.parallelize`
applies the decision.

The estimate is deliberately simple (no allocator fragmentation, no communication buckets, no
CUDA context); `StrategyPolicy`'s `headroom` (default 80%) is the allowance for everything it
leaves out.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "MemoryEstimate",
    "checkpointed_activations",
    "cpu_budget_bytes",
    "estimate",
    "fsdp_blocks",
    "gpu_budget_bytes",
    "largest_block_bytes",
    "probe_activation_bytes",
]

_GIB = 1 << 30


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one rank needs, before any sharding.

    largest_block_bytes is FSDP's allowance for one unit's parameters gathered unsharded during
    its all-gather (see `largest_block_bytes()`); it does not count towards DDP.
    """

    param_bytes: int  # every parameter, at its own dtype
    grad_bytes: int  # trainable parameters only, same dtype as the parameter
    optimizer_bytes: int  # optimizer state, by optimizer type (see `estimate`)
    activation_bytes: int  # saved for backward in one micro-batch (measured or the user's hint)
    largest_block_bytes: int = 0  # biggest FSDP unit's parameters, gathered during all-gather
    # With activation checkpointing per block (`checkpointed_activations`); None: the model has
    # no blocks to checkpoint, or it was not measured.
    checkpointed_activation_bytes: int | None = None
    # Parameters, gradients and optimizer state kept in host memory (offload), not on the device.
    host_bytes: int = 0

    def under(self, *, checkpointing: bool, offload: bool) -> MemoryEstimate:
        """What the device holds with activation checkpointing and/or offload: checkpointing
        keeps `checkpointed_activation_bytes` of activations; offload moves the parameters,
        gradients and optimizer state to `host_bytes` (one block is still gathered on the
        device, as `largest_block_bytes`)."""
        e = self
        if checkpointing:
            if e.checkpointed_activation_bytes is None:
                raise ValueError("this estimate has no figure for activation checkpointing")
            e = dataclasses.replace(e, activation_bytes=e.checkpointed_activation_bytes)
        if offload:
            states = e.param_bytes + e.grad_bytes + e.optimizer_bytes
            e = dataclasses.replace(
                e, param_bytes=0, grad_bytes=0, optimizer_bytes=0, host_bytes=states
            )
        return e

    def ddp_bytes(self) -> int:
        """Everything replicated on every rank."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def sharded_bytes(self, world_size: int) -> int:
        """This rank's 1/world_size share of params, grads and optimizer state (rounded up)."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size}: must be >= 1")
        states = self.param_bytes + self.grad_bytes + self.optimizer_bytes
        return math.ceil(states / world_size)

    def fsdp_bytes(self, world_size: int) -> int:
        """Params, grads and optimizer state sharded 1/world_size, plus one unsharded block.

        Activations are not sharded (each rank runs its own micro-batch). The block allowance is
        one unit's parameters during its all-gather; FSDP2's prefetch of the next unit and the
        block's unsharded gradients before reduce-scatter are left to the headroom.
        """
        return self.sharded_bytes(world_size) + self.largest_block_bytes + self.activation_bytes


def _param_bytes(params: Iterator[torch.nn.Parameter] | list[torch.nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _optimizer_state_factor(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    """How many param-sized state tensors `optimizer` keeps for each param of `group`.

    Known optimizers are counted exactly (scalar `step` tensors are ignored); an unknown one is
    assumed to keep 2 (as Adam does), a deliberately cautious guess.
    """
    adam_like = (torch.optim.Adam, torch.optim.AdamW)
    if isinstance(optimizer, adam_like):
        return 3 if group.get("amsgrad", False) else 2  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if group.get("momentum", 0) else 0  # momentum_buffer
    if isinstance(optimizer, torch.optim.Adagrad):
        return 1  # sum
    if isinstance(optimizer, torch.optim.RMSprop):
        # square_avg (+ momentum_buffer) (+ grad_avg when centered)
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    return 2  # NAdam, RAdam, Adamax keep two; anything unknown is assumed to as well


def estimate(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, activation_bytes: int
) -> MemoryEstimate:
    """Per-rank bytes of `model` trained by `optimizer`, unsharded.

    Guarantees: each tensor is counted at its own dtype's size; a parameter shared by several
    modules (weight tying) is counted once; gradients are counted for trainable params only;
    optimizer state for the params in `optimizer`'s groups, by type: Adam/AdamW 2x (3x with
    amsgrad), SGD 1x with momentum and 0x without, Adagrad 1x, RMSprop 1-3x, NAdam/RAdam/Adamax
    2x, anything else 2x. Buffers (e.g. BatchNorm statistics) are not counted.
    """
    if activation_bytes < 0:
        raise ValueError(f"activation_bytes={activation_bytes}: must be >= 0")
    params = list(model.parameters())  # parameters() yields a tied parameter once
    seen: set[int] = set()
    optimizer_bytes = 0
    for group in optimizer.param_groups:
        factor = _optimizer_state_factor(optimizer, group)
        for p in group["params"]:
            if id(p) in seen:
                continue
            seen.add(id(p))
            optimizer_bytes += factor * p.numel() * p.element_size()
    return MemoryEstimate(
        param_bytes=_param_bytes(params),
        grad_bytes=_param_bytes([p for p in params if p.requires_grad]),
        optimizer_bytes=optimizer_bytes,
        activation_bytes=int(activation_bytes),
        largest_block_bytes=largest_block_bytes(model),
    )


def fsdp_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP wraps one by one: the children of the first nn.ModuleList found (in
    `modules()` order), or [] when the model has none (then only the root is wrapped)."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            return list(module)
    return []


def largest_block_bytes(model: torch.nn.Module) -> int:
    """Biggest parameter footprint among the units FSDP would gather at once.

    The units are those `raymesh.train.rank.parallelize` shards one by one (`fsdp_blocks`: the
    children of the first nn.ModuleList) and the root, which owns every parameter outside them
    (embeddings, heads); with no ModuleList the root is the whole model.
    """
    blocks = fsdp_blocks(model)
    in_blocks: set[int] = set()
    sizes = [0]
    for block in blocks:
        block_params = [p for p in block.parameters() if id(p) not in in_blocks]
        in_blocks.update(id(p) for p in block_params)
        sizes.append(_param_bytes(block_params))
    sizes.append(_param_bytes([p for p in model.parameters() if id(p) not in in_blocks]))
    return max(sizes)


def probe_activation_bytes(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor],
    batch: Any,
    *,
    autocast: torch.dtype | None = None,
    inputs_of: Sequence[torch.nn.Module] = (),
) -> int:
    """Bytes autograd saves for backward in one forward of `loss_fn(model, batch)`, under
    `autocast` to that dtype when given (as the step runs it). `inputs_of`: modules whose
    tensor inputs count too (checkpointed blocks: they keep their inputs, which autograd does
    not see saved; what they save inside is their checkpoint's, not counted).

    Works on CPU and GPU alike (it counts saved tensors, not allocator statistics). Each storage
    is counted once, whole; the model's own parameters are excluded (they are in param_bytes).
    The probe runs no backward and leaves no trace: the RNG streams and the model's buffers
    (e.g. BatchNorm running statistics) are restored, so a run that probes trains exactly like
    one that does not. A model built on the meta device is probed with fake tensors in place of
    its meta ones (`_fakes_for_meta`): shapes and dtypes without memory, on `batch`'s device.
    """
    mode, fakes = _fakes_for_meta(model, _device_of(batch))
    params = [fakes.get(id(p), p) for p in model.parameters()]
    param_storages = {_storage_key(p) for p in params}
    seen: set[int] = set()
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        try:
            storage = t.untyped_storage()
            key, nbytes = _storage_key(t), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensor subclasses without a storage
            key, nbytes = id(t), t.numel() * t.element_size()
        if key not in param_storages and key not in seen:
            seen.add(key)
            total += nbytes
        # Not `t` itself: a saved tensor that is its own graph's input makes a reference cycle
        # through the C++ graph that Python's collector cannot see, and the probe's activations
        # would stay resident (about 175 MB for a small Llama). Nothing unpacks it: no backward.
        return t.detach()

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def count_inputs(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor):
                pack(t)

    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    rng = torch.random.fork_rng(devices=devices)  # the CPU stream, plus the model's GPUs
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    device = next((p.device.type for p in params), "cpu")
    cast = (
        torch.autocast(device, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    )
    hooks = [m.register_forward_pre_hook(count_inputs, with_kwargs=True) for m in inputs_of]
    try:
        with (
            rng,
            _swapped(model, mode, fakes),
            cast,
            torch.enable_grad(),
            torch.autograd.graph.saved_tensors_hooks(pack, unpack),
        ):
            loss = loss_fn(model, batch)
            del loss  # frees the graph and everything it saved
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    return total


def _storage_key(t: torch.Tensor) -> int:
    # The storage's own address, not its data's: a meta or fake tensor has no data (every
    # data_ptr is 0), and views of one storage share it either way.
    return int(t.untyped_storage()._cdata)


def _device_of(batch: Any) -> torch.device:
    """The device of the first tensor in `batch` (nested in lists, tuples, dicts); else CPU."""
    if isinstance(batch, torch.Tensor):
        return batch.device
    items = batch.values() if isinstance(batch, dict) else batch
    if isinstance(items, (list, tuple)) or isinstance(batch, dict):
        for item in items:
            found = _device_of(item)
            if found.type != "cpu":
                return found
    return torch.device("cpu")


def _fakes_for_meta(
    model: torch.nn.Module, device: torch.device
) -> tuple[Any, dict[int, torch.Tensor]]:
    """(a fake tensor mode, {id(tensor): a fake tensor of its shape and dtype on `device`}) for
    the model's parameters and buffers on the meta device; (None, {}) when none is. Fake
    tensors run a real forward (autocast included, which meta tensors skip) while allocating
    nothing, so a model built on the meta device is probed before a byte of it exists. Code
    that branches on values sees none: transformers then keeps a causal mask (and repeats the
    KV heads for it) that it drops for real tensors, ~10 % more on a small Llama, never less.
    PyTorch's fake tensors are private API (torch._subclasses) but what torch.compile and
    torch.export are built on; a torch without them fails the probe, not the job's results."""
    meta = [t for t in (*model.parameters(), *model.buffers()) if t.is_meta]
    if not meta:
        return None, {}
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = {
            id(t): torch.empty(t.shape, dtype=t.dtype, device=device).requires_grad_(
                t.requires_grad
            )
            for t in meta
        }
    return mode, fakes


@contextlib.contextmanager
def _swapped(model: torch.nn.Module, mode: Any, fakes: dict[int, torch.Tensor]) -> Iterator[None]:
    """Within it, every module's meta parameters and buffers are their fakes (a tied one in
    every module that holds it), under `mode`; all are put back on exit."""
    if mode is None:
        yield
        return
    swapped: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, t in table.items():
                if t is not None and id(t) in fakes:
                    swapped.append((table, name, t))
                    table[name] = fakes[id(t)]
    try:
        with mode:
            yield
    finally:
        for table, name, t in swapped:
            table[name] = t


def checkpointed_activations(full: int, checkpointed: int, blocks: int) -> int:
    """Activation bytes with checkpointing per block, from two probes: `full` (no
    checkpointing) and `checkpointed` (the blocks checkpointed: what autograd saves outside
    them, plus each block's input, kept to recompute from). During the backward one block at a
    time recomputes its own activations, about (`full` - `checkpointed`) / `blocks`."""
    if blocks < 1:
        raise ValueError(f"blocks={blocks}: checkpointing needs at least one block")
    return checkpointed + max(0, full - checkpointed) // blocks


def cpu_budget_bytes(config_memory_budget_gb: float | None, ranks_per_host: int = 1) -> int:
    """The per-rank budget on CPU: the configured GiB, else this host's memory split evenly
    among `ranks_per_host` ranks (MemTotal from /proc/meminfo, else sysconf)."""
    if config_memory_budget_gb is not None:
        if not config_memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb={config_memory_budget_gb}: must be > 0 (GiB)")
        return int(config_memory_budget_gb * _GIB)
    if ranks_per_host < 1:
        raise ValueError(f"ranks_per_host={ranks_per_host}: must be >= 1")
    return _host_memory_bytes() // ranks_per_host


def _host_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or an unreadable procfs: ask sysconf instead
    return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))


def gpu_budget_bytes(device_index: int) -> int:
    """Total memory of CUDA device `device_index` (call only where CUDA is available)."""
    return int(torch.cuda.get_device_properties(device_index).total_memory)
