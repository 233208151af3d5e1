"""A driven job's step of samples as it travels to the ranks: a list of samples whose tensors
are packed into one buffer per key (`Packed`), so that the object store writes and reads a few
tensors, not every sample's own.

Each tensor is serialised on its own, at a fixed cost (~20 us to write, ~10 us to read, beside
its bytes): a GRPO step of 32 completions is 96 small tensors, about 5 ms of a step's 50 ms on
two cores (bench/rl.py --overhead). Packed, it is 3. `unpack` gives back each sample as it was:
its keys in order, its numbers, its tensors (of the same dtype, shape and values; views of the
key's buffer, read-only as anything read from the object store is).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Packed", "pack", "unpack"]


@dataclass(frozen=True)
class Packed:
    """Samples (dicts) with their tensors packed: `buffers[key]` holds every sample's tensor of
    `key`, flattened and in order, of the shapes `shapes[key]`; `rest` each sample's other
    values (a tensor's place holds None)."""

    keys: tuple[str, ...]
    buffers: dict[str, torch.Tensor]
    shapes: dict[str, list[tuple[int, ...]]]
    rest: list[dict[str, Any]]


def pack(samples: Sequence[Any] | dict[str, torch.Tensor]) -> Any:
    """`samples` with the tensors of each key packed, where every sample is a dict of the same
    keys and that key is a CPU tensor of one dtype in all of them; anything else (columns, a
    sample of another kind, a GPU tensor) as it is."""
    if not isinstance(samples, list) or not samples or not isinstance(samples[0], dict):
        return samples
    keys = tuple(samples[0])
    if any(not isinstance(s, dict) or tuple(s) != keys for s in samples):
        return samples
    packed = [
        k
        for k in keys
        if all(isinstance(s[k], torch.Tensor) and s[k].device.type == "cpu" for s in samples)
        and len({s[k].dtype for s in samples}) == 1
    ]
    if not packed:
        return samples
    return Packed(
        keys=keys,
        buffers={k: torch.cat([s[k].detach().reshape(-1) for s in samples]) for k in packed},
        shapes={k: [tuple(s[k].shape) for s in samples] for k in packed},
        rest=[{k: (None if k in packed else v) for k, v in s.items()} for s in samples],
    )


def unpack(samples: Any) -> Any:
    """The samples `pack` was given (anything not `Packed`: as it is)."""
    if not isinstance(samples, Packed):
        return samples
    out = [dict(r) for r in samples.rest]
    for k, buffer in samples.buffers.items():
        shapes = samples.shapes[k]
        sizes = [int(torch.Size(shape).numel()) for shape in shapes]
        for s, flat, shape in zip(out, torch.split(buffer, sizes), shapes):
            s[k] = flat.view(shape)
    return [{k: s[k] for k in samples.keys} for s in out]
