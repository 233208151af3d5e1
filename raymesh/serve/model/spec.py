"""What a replica serves (`ModelSpec`, plain data the controller checks and sends); the replica
loads it as a `LoadedModel` (`raymesh.serve.model.loaded`, in the replica's process).

A model is one of:
- a raymesh.train build function (`build="pkg.module:build"` or the function): the replica calls
  it as a one-rank job would, takes `Task.model`, and loads the checkpoint's weights; the
  input's shape and dtype are read from the task's first sample when not given;
- an `nn.Module`: sent to the replica as is, its weights replaced by the checkpoint's if given;
- a plain callable `predict(batch) -> outputs`, called on the stacked batch;
- a Hugging Face folder (`hf=`, as `raymesh export --hf` writes it: a causal LM, or a LoRA
  adapter naming its local base folder), loaded with `raymesh.train.hf.load_causal_lm`; it
  generates with `raymesh.train.hf.generate` unless told otherwise, and predicts the logits
  of a list of token ids;
- a checkpoint alone (`checkpoint=` and none of the above): rebuilt as `rebuild` rebuilds it
  with no build function given: with the build function its job named, where that imports
  here, else from the transformers (or PEFT) model its manifest records (`Manifest.hf`). A
  causal LM so recorded is served as an hf folder is: generate (the tokenizer of the recorded
  base folder), the logits of token ids, prompts held to its context.
The checkpoint is a raymesh.train checkpoint folder (its newest committed step that verifies)
or one step's folder; the model is rebuilt from it as `raymesh.train.export.rebuild` does (the
build function called as one rank of the job, with the job's config from the manifest, or the
model its record describes) and its weights are read with `export_state_dict` (checksums
verified, tensors only, DCP's `.metadata` by an unpickler that refuses anything but DCP's
metadata: no checkpoint file runs code in a replica).

`generate`, when given, serves POST /v1/generate: `generate(model, prompt, max_tokens,
temperature, seed)` yields text pieces (one token each), which the front streams.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raymesh._common import bad, is_int, resolve
from raymesh.train import Context, Task
from raymesh.train.checkpoint import (
    check_named_paths,
    check_record,
    read_manifest,
    resolve_checkpoint,
)
from raymesh.train.export import job_config, rebuild_plan

__all__ = [
    "ModelInfo",
    "ModelSpec",
    "PromptTooLong",
    "check_under_root",
    "resolve_checkpoint",
]

HF_GENERATE = "raymesh.train.hf:generate"  # what a causal LM generates with, unless told
# The input dtypes a served model takes, by name (the request's numbers become these).
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


class PromptTooLong(ValueError):
    """A /v1/generate prompt whose tokens and `max_tokens` do not fit the model's context
    (HTTP 400, naming the limit)."""


def check_under_root(path: str | Path, root: str | Path, *, files: bool = False) -> Path:
    """`path` with every symlink resolved, if it lies under `root` (resolved too); with
    `files`, every file and folder under it must resolve under `root` as well (a link inside a
    checkpoint that points out of the root counts as out), and so must every file or folder its
    manifest's params name (what rebuilding the model reads: `check_named_paths`).
    PermissionError naming the root otherwise. Nothing outside the root is read to decide:
    only the links on the way."""
    real_root = Path(root).resolve()
    real = Path(path).resolve()
    outside = None if real.is_relative_to(real_root) else real
    if outside is None and files and real.is_dir():
        outside = next(
            (p for p in real.rglob("*") if not p.resolve().is_relative_to(real_root)), None
        )
    if outside is not None:
        shown = "it" if outside == real else f"{str(outside)!r} in it"
        raise PermissionError(
            f"checkpoint={str(path)!r}: {shown} is outside checkpoint_root={str(root)!r} "
            f"(resolved: {str(real_root)!r}); reloads load only from under it"
        )
    if files:
        check_named_paths(real, root)
    return real


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What every replica loads. Checked on construction (ValueError naming the field)."""

    model: Any = None  # an nn.Module, or a predict(batch) callable
    build: str | Callable[[Context], Task] | None = None  # a raymesh.train build function
    hf: str | None = None  # a Hugging Face save_pretrained folder (a causal LM or an adapter)
    checkpoint: str | None = None  # resolved to a step folder by `resolved()`; alone: see there
    generate: str | Callable[..., Iterator[str]] | None = None  # hf: raymesh.train.hf's
    input_shape: tuple[int, ...] | None = None  # one request's input; None: from the task
    input_dtype: str | None = None  # "float32" (default; hf: "int64"), "float64" or "int64"
    seed: int = 0
    # A checkpoint alone: how it is rebuilt, decided once by `resolved()` (not given by hand).
    pinned: Pinned | None = None

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.model, self.build, self.hf))
        if given > 1 or (given == 0 and self.checkpoint is None):
            raise ValueError(
                "give one of the model (an nn.Module or a predict function), build= (a "
                "raymesh.train build function, e.g. 'pkg.module:build'), hf= (a Hugging Face "
                "model folder) or a checkpoint alone (checkpoint=: rebuilt as it records), not "
                "several or none"
            )
        if self.hf is not None:
            self._check_hf()
        if self.model is not None and not callable(self.model):
            raise ValueError(f"model={type(self.model).__name__}: give an nn.Module or a function")
        if isinstance(self.build, str):
            resolve(self.build)  # fail here, not in every replica
        if isinstance(self.generate, str):
            resolve(self.generate, "generate")
        plain_fn = self.model is not None and not isinstance(self.model, torch.nn.Module)
        if self.checkpoint is not None and plain_fn:
            raise ValueError(
                "checkpoint= needs a module to load into: give an nn.Module or build=, not a "
                "plain function"
            )
        if self.input_shape is not None:
            shape = tuple(self.input_shape)
            if not all(is_int(d) and d >= 1 for d in shape):
                raise ValueError(f"input_shape={self.input_shape!r}: give sizes >= 1, e.g. (16,)")
            object.__setattr__(self, "input_shape", shape)
        if self.input_dtype is not None and self.input_dtype not in DTYPES:
            raise ValueError(f"input_dtype={self.input_dtype!r}: give one of {sorted(DTYPES)}")

    def _check_hf(self) -> None:
        object.__setattr__(self, "hf", str(self.hf))  # a Path too
        folder = Path(self.hf)  # type: ignore[arg-type]
        if not any((folder / f).is_file() for f in ("config.json", "adapter_config.json")):
            raise ValueError(
                f"hf={self.hf!r}: not a Hugging Face model folder (no config.json or "
                "adapter_config.json); write one with `raymesh export RUN --hf OUT`"
            )
        if self.checkpoint is not None:
            raise ValueError(
                f"checkpoint={self.checkpoint!r}: an hf folder holds its own weights; export a "
                "checkpoint to a folder (`raymesh export RUN --hf OUT`) and serve that"
            )
        self._causal_lm_defaults()

    def _causal_lm_defaults(self) -> None:
        if self.generate is None:  # a causal LM generates text
            object.__setattr__(self, "generate", HF_GENERATE)
        if self.input_dtype is None:  # predict takes token ids
            object.__setattr__(self, "input_dtype", "int64")

    @property
    def alone(self) -> bool:
        """Whether the model is the checkpoint's alone (no model, build or hf given)."""
        return self.model is None and self.build is None and self.hf is None

    def resolved(self) -> ModelSpec:
        """This spec with `checkpoint` pinned to one step folder (so every replica, and a
        replacement started later, loads the same weights). A checkpoint alone must be
        rebuildable (its job's build function imports here, or it records a transformers model:
        ValueError naming it and the fix otherwise); a causal LM it records takes token ids and,
        with its base folder recorded, generates with raymesh.train.hf's `generate`.

        How a checkpoint alone is rebuilt (its job's build function, or its record) is decided
        on the first call (at deploy: the only time the build its manifest names is imported)
        and kept in `pinned`; on a spec already pinned (a reload) nothing the new manifest
        names is imported, and a manifest naming another build than the pinned checkpoint's
        is refused (PermissionError naming `config.build`): whoever can write a checkpoint
        folder does not choose which code the server runs."""
        if self.checkpoint is None:
            return self
        spec = dataclasses.replace(self, checkpoint=str(resolve_checkpoint(self.checkpoint)))
        if spec.alone:
            spec._check_record()
        return spec

    def _check_record(self) -> None:
        step = Path(str(self.checkpoint))
        named = job_config(step).build  # ValueError naming the checkpoint if unreadable
        pinned = self.pinned
        if pinned is None:  # deploy: the one decision, which imports the named build
            build = rebuild_plan(step, named=named)  # a name: no build is given
            pinned = Pinned(named, None if build is None else str(build))
            object.__setattr__(self, "pinned", pinned)
        elif named != pinned.named:
            raise PermissionError(
                f"checkpoint={str(step)!r}: its manifest's config.build={named!r} is not the "
                f"served checkpoint's ({pinned.named!r}); a reload never runs another build "
                "function: serve this checkpoint from a new server"
            )
        why = None
        if pinned.build is None:
            why = (
                "its job names no build function"
                if named is None
                else f"its job's build {named!r} cannot be imported here"
            )
        record = read_manifest(step).hf
        if not record and why is not None:
            fix = 'build= in Python, or a job file whose build = "module:function" imports'
            raise bad(
                "checkpoint",
                str(step),
                f"{why}, and it records no Hugging Face model to rebuild from; give the build "
                f"function that trained it ({fix})",
            )
        record = check_record(record, f"checkpoint={str(step)!r}") if record else {}
        if str(record.get("class", "")).endswith("ForCausalLM"):
            if record.get("base") is not None:  # its tokenizer's folder: without one, no text
                self._causal_lm_defaults()
            object.__setattr__(self, "input_dtype", self.input_dtype or "int64")


@dataclass(frozen=True)
class Pinned:
    """How a checkpoint served alone is rebuilt, decided at deploy and kept for every replica
    and reload: `build` ("module:function", its job's) called as one rank of the job, or None:
    from the checkpoint's Hugging Face record. `named`: what its manifest's `config.build`
    names (a reload's checkpoint must name the same)."""

    named: str | None
    build: str | None


@dataclass
class ModelInfo:
    """What the front needs to know about the loaded model (sent back by each replica)."""

    input_shape: tuple[int, ...] | None
    input_dtype: str
    generates: bool
    checkpoint: str | None
    device: str
    # The streams the replica decodes at once (1: one at a time; see LoadedModel.decoder).
    max_streams: int = 1
