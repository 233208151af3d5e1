"""What a checkpoint of a Hugging Face model records so that it can be rebuilt without its build
function (`Manifest.hf`): `hf_record` writes it at save time, `check_record` reads it back.

A transformers model (a `PreTrainedModel`) or a PEFT model on one is rebuilt from its class
name, its config and, for PEFT, its adapters' configs; the checkpoint holds every weight. The
record also names the folder the base model was loaded from, when it was, for its tokenizer and
for an exported adapter's `base_model_name_or_path`:

    {"format": 1, "class": "LlamaForCausalLM", "config": {...config.to_dict()...},
     "peft": {"active": "default", "adapters": {"default": {...LoraConfig...}}} or None,
     "base": "/abs/models/tiny" or None, "transformers": "5.25.0"}

Nothing here imports transformers or peft: a model is recognised only when they are imported
already (a model of theirs exists only then). The record is data: rebuilding from it looks the
class up among transformers' own exported names (raymesh.train.export), never imports what it
names, and the checkpoint's weights must then fit the model key for key.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["RECORD_FORMAT", "check_record", "hf_record"]

RECORD_FORMAT = 1


def hf_record(model: torch.nn.Module) -> dict[str, Any]:
    """The record of `model` (a transformers or PEFT model, plain, in DDP, compiled, or sharded
    by FSDP2), or {} for any other model. JSON data."""
    model = _unwrap(model)
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return {}
    peft = sys.modules.get("peft")
    peft_part = None
    base: Any = model
    if peft is not None and isinstance(model, peft.PeftModel):
        base = model.get_base_model()
        adapters = {
            name: json.loads(json.dumps(config.to_dict(), default=_jsonable))
            for name, config in model.peft_config.items()
        }
        peft_part = {"active": model.active_adapter, "adapters": adapters}
    if not isinstance(base, transformers.PreTrainedModel):
        return {}
    cls = next(
        (c for c in type(base).__mro__ if c.__module__.startswith("transformers.")), None
    )  # FSDP2 makes a subclass of the model's class: the class transformers exports
    if cls is None:
        return {}
    folder = getattr(base, "name_or_path", "") or getattr(base.config, "_name_or_path", "")
    return {
        "format": RECORD_FORMAT,
        "class": cls.__name__,
        "config": json.loads(base.config.to_json_string(use_diff=False)),
        "peft": peft_part,
        "base": str(Path(folder).absolute()) if folder and Path(folder).is_dir() else None,
        "transformers": str(transformers.__version__),
    }


def check_record(record: Any, where: str) -> dict[str, Any]:
    """`record` if it has the shape `hf_record` writes; ValueError naming `where` and the
    field otherwise (a manifest edited by hand, or written by another raymesh)."""

    def refuse(field: str, value: Any, why: str) -> ValueError:
        return ValueError(f"{where}: hf.{field}={value!r:.80}: {why}")

    if not isinstance(record, dict):
        raise refuse("", record, "expected a JSON object")
    if record.get("format") != RECORD_FORMAT:
        raise refuse("format", record.get("format"), f"this raymesh reads {RECORD_FORMAT} only")
    name = record.get("class")
    if not isinstance(name, str) or not name.isidentifier():
        raise refuse("class", name, "expected a transformers class name")
    config = record.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise refuse("config", config, "expected a transformers config with its model_type")
    peft = record.get("peft")
    if peft is not None:
        adapters: Any = peft.get("adapters") if isinstance(peft, dict) else None
        ok = isinstance(adapters, dict) and adapters and peft.get("active") in adapters
        if not ok or not all(isinstance(c, dict) and "peft_type" in c for c in adapters.values()):
            raise refuse("peft", peft, "expected {active, adapters: {name: PEFT config}}")
    base = record.get("base")
    if base is not None and not isinstance(base, str):
        raise refuse("base", base, "expected the base model's folder or null")
    return record


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    # DDP holds the model as .module, torch.compile as ._orig_mod; FSDP2 shards it in place.
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None)
        if inner is None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            inner = model.module
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner
    return model


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset, tuple)):  # PEFT keeps target_modules as a set
        return sorted(value, key=str)
    return str(value)
