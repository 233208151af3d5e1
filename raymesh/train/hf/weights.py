"""Pretrained weights read where they are needed: `PretrainedWeights(folder)` is the
`Task.init_weights` of a causal LM built on the meta device (`load_causal_lm(..., meta=True)`).

The trainer calls it once the model is sharded and its local shards allocated: it hands every
parameter and persistent buffer, as it is on this rank (a DTensor shard under FSDP/HSDP), to
DCP's `HuggingFaceStorageReader`, which reads from the folder's safetensors only the slices
this rank holds. So no rank ever reads or holds the whole model, whatever its size. Under DDP
each rank's "shard" is the whole tensor, and it reads everything, as a replica must.

Names: a PEFT model's parameters are its base model's under `base_model.model.` with the
adapted layers' weights under `.base_layer`; they are looked up by the base model's names,
which are the file's. A new LoRA adapter's matrices are in no file: they are initialised as
PEFT does (A Kaiming-uniform, B zero, so the adapted model starts equal to its base), drawn
from `seed` on the CPU whole and sliced to each rank's shard, so every strategy and world size
starts from the same adapter.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from raymesh._common import bad

__all__ = ["PretrainedWeights"]

_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class PretrainedWeights:
    """Fills a model built on meta from a `save_pretrained` folder's safetensors (see the
    module). ValueError naming the folder when it holds no safetensors, or lacks a weight the
    model has (another model's folder), before any weight is read."""

    folder: Path
    seed: int = 0  # draws the A matrices of a new LoRA adapter

    def __call__(self, model: torch.nn.Module) -> None:
        import torch.distributed.checkpoint as dcp

        stored = _stored_keys(self.folder)
        state = model.state_dict(keep_vars=True)  # tied weights: one object under two names
        load: dict[str, torch.Tensor] = {}
        filled: set[int] = set()
        for name, t in state.items():
            key = _file_key(name)
            if key in stored and id(t) not in filled:
                load[key] = t.detach()  # the same storage: DCP writes into it in place
                filled.add(id(t))
        fresh = [(n, t) for n, t in state.items() if id(t) not in filled and _is_lora(n)]
        missing = [n for n, t in state.items() if id(t) not in filled and not _is_lora(n)]
        if missing:
            raise bad(
                "model",
                str(self.folder),
                f"its safetensors have no weight for {len(missing)} of the model's tensors "
                f"(e.g. {', '.join(_file_key(n) for n in missing[:3])}); give the folder this "
                "model's config came from",
            )
        # no_dist: each rank plans its own reads, with no collective, so one rank can load
        # alone (a replacement joining survivors that hold their weights already).
        reader = dcp.HuggingFaceStorageReader(str(self.folder))
        dcp.load(load, storage_reader=reader, no_dist=True)
        for i, (name, t) in enumerate(sorted(fresh, key=lambda nt: nt[0])):
            _fill(t, _lora_init(name, tuple(t.shape), self.seed + i))


def _stored_keys(folder: Path) -> set[str]:
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise bad(
            "model",
            str(folder),
            "no *.safetensors in this folder; save the model with "
            "model.save_pretrained(folder) (safetensors is its default)",
        )
    index = folder / "model.safetensors.index.json"
    if index.is_file():  # a sharded save: the index names every key, no file need be opened
        return set(json.loads(index.read_text())["weight_map"])
    keys: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as opened:  # reads the header only
            keys.update(opened.keys())
    return keys


def _file_key(name: str) -> str:
    """The name a base model's save_pretrained gives the tensor `name` of the (PEFT) model."""
    return name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")


def _is_lora(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _lora_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """PEFT's default: A Kaiming-uniform with a = sqrt(5), i.e. U(-1/sqrt(fan_in), ..), B zero."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed)
    bound = 1 / math.sqrt(shape[1]) if len(shape) > 1 else 1.0
    return torch.empty(shape).uniform_(-bound, bound, generator=generator)


def _fill(t: torch.Tensor, full: torch.Tensor) -> None:
    """Copy `full` (the whole tensor) into `t`, or into its local shard when it is a DTensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(t, DTensor):
        # src_data_rank=None: each rank slices its own chunk of `full`, no communication.
        local = distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None)
        t.to_local().copy_(local.to_local())
    else:
        t.copy_(full)
