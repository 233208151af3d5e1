"""What a replica serves (`ModelSpec`, plain data the controller checks and sends) and the model
it loads from it (`LoadedModel`, built in the replica's process).

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
import functools
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raymesh._common import bad, resolve
from raymesh.train import Context, Task
from raymesh.train.checkpoint import (
    check_named_paths,
    check_record,
    load_weights,
    read_manifest,
    resolve_checkpoint,
)
from raymesh.train.export import from_record, job_config, rebuild, rebuild_plan

__all__ = [
    "LoadedModel",
    "ModelInfo",
    "ModelSpec",
    "PromptTooLong",
    "check_under_root",
    "resolve_checkpoint",
]

HF_GENERATE = "raymesh.train.hf:generate"  # what a causal LM generates with, unless told
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64}


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
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
                raise ValueError(f"input_shape={self.input_shape!r}: give sizes >= 1, e.g. (16,)")
            object.__setattr__(self, "input_shape", shape)
        if self.input_dtype is not None and self.input_dtype not in _DTYPES:
            raise ValueError(f"input_dtype={self.input_dtype!r}: give one of {sorted(_DTYPES)}")

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


class LoadedModel:
    """A model ready to answer, in a replica's process."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self.device = device
        shape, dtype = spec.input_shape, spec.input_dtype
        module: torch.nn.Module | None = None
        if spec.build is not None or spec.alone:
            # A checkpoint alone: as decided at deploy, never by what its manifest names now.
            pinned = spec.pinned if spec.alone else None
            if pinned is not None and pinned.build is None:
                task = from_record(str(spec.checkpoint), device=device, seed=spec.seed)
            else:
                build = pinned.build if pinned is not None else spec.build
                task = rebuild(spec.checkpoint, build=build, device=device, seed=spec.seed)
            module = task.model
            if shape is None or dtype is None:
                first = _first_input(task)
                if first is not None:
                    shape = shape or tuple(first.shape)
                    dtype = dtype or _dtype_name(first.dtype)
        elif spec.hf is not None:
            from raymesh.train import hf  # needs transformers: only where an hf folder is served

            module = hf.load_causal_lm(spec.hf)
        elif isinstance(spec.model, torch.nn.Module):
            module = spec.model
            if spec.checkpoint is not None:
                load_weights(module, spec.checkpoint)
        # A causal LM from a folder or from a checkpoint alone is served alike: the logits of
        # token ids, and prompts held to its context.
        causal_lm = spec.hf is not None or (spec.alone and _is_causal_lm(module))
        if module is not None:
            module = module.to(device).eval()
            self.fn: Callable[[Any], Any] = module
            if causal_lm:
                self.fn = functools.partial(_logits, module)
        else:
            self.fn = spec.model
        self.module = module
        self.generate_fn = None if spec.generate is None else resolve(spec.generate, "generate")
        self.dtype = _DTYPES[dtype or "float32"]
        self.info = ModelInfo(
            input_shape=shape,
            input_dtype=dtype or "float32",
            generates=self.generate_fn is not None,
            checkpoint=spec.checkpoint,
            device=str(device),
        )
        # A Hugging Face model's context, in tokens (its position embeddings): /v1/generate
        # refuses a prompt that, with max_tokens, would not fit (see check_context). Decided
        # here, once: without the folder of its tokenizer there is nothing to count with.
        config = getattr(module, "config", None) if causal_lm else None
        context = getattr(config, "max_position_embeddings", None)
        self._folder: Path | None = None
        if module is not None and isinstance(context, int):
            self._folder = _folder_of(module)
        self.context: int | None = context if self._folder is not None else None
        self._tokenizer: Any = None

    def check_context(self, prompt: str, max_tokens: int) -> None:
        """PromptTooLong, naming the limit, when the prompt's tokens and `max_tokens` make more
        than the model's context (a Hugging Face model whose folder is known; others have no
        context to know: a causal LM with no known folder, rebuilt from a record without its
        base folder or built from a config, has no tokenizer to count with and is not
        checked). A refusal, not a crop: the client decides which part of its prompt
        matters."""
        if self.context is None or self._folder is None:
            return
        if self._tokenizer is None:
            from raymesh.train import hf

            self._tokenizer = hf.load_tokenizer(self._folder)
        # As raymesh.train.hf.generate counts them: no special tokens, at least one.
        tokens = len(self._tokenizer(prompt, add_special_tokens=False)["input_ids"]) or 1
        if tokens + max_tokens > self.context:
            raise PromptTooLong(
                f"prompt: {tokens} tokens and max_tokens={max_tokens} make "
                f"{tokens + max_tokens}, over the model's context of {self.context} tokens "
                "(max_position_embeddings): shorten the prompt or ask for fewer tokens"
            )

    def predict(self, inputs: list[Any]) -> tuple[list[Any], dict[int, tuple[str, str]]]:
        """One output per input, in order, and {index: (exception type, message)} for the
        inputs the model failed on (their output is None). The batch runs as one call of the
        model; if that raises, each input runs alone, so only the inputs the model fails on
        get an error."""
        try:
            return self._call(inputs), {}
        except Exception:
            pass
        values: list[Any] = []
        errors: dict[int, tuple[str, str]] = {}
        for i, x in enumerate(inputs):
            try:
                values.append(self._call([x])[0])
            except Exception as e:
                values.append(None)
                errors[i] = (type(e).__name__, str(e)[:500])
        return values, errors

    def _call(self, inputs: list[Any]) -> list[Any]:
        x = torch.tensor(inputs, dtype=self.dtype, device=self.device)
        with torch.inference_mode():
            y = self.fn(x)
        if isinstance(y, torch.Tensor):
            if y.dim() == 0 or y.shape[0] != len(inputs):
                raise ValueError(
                    f"the model returned shape {tuple(y.shape)} for a batch of {len(inputs)}; "
                    "it must return one row per input"
                )
            out: list[Any] = y.detach().cpu().tolist()
            return out
        rows = list(y)
        if len(rows) != len(inputs):
            raise ValueError(f"the model returned {len(rows)} outputs for {len(inputs)} inputs")
        return [r.detach().cpu().tolist() if isinstance(r, torch.Tensor) else r for r in rows]

    def generate(
        self, prompt: str, max_tokens: int, temperature: float, seed: int
    ) -> Generator[str, None, None]:
        """The generate function's pieces; PromptTooLong first when a Hugging Face model's
        prompt and `max_tokens` pass its context (`check_context`)."""
        if self.generate_fn is None:
            raise ValueError("this model has no generate function")
        self.check_context(prompt, max_tokens)
        with torch.inference_mode():
            yield from self.generate_fn(self.module, prompt, max_tokens, temperature, seed)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """A causal LM's next-token logits at every position of each input [B, T] of token ids."""
    logits: torch.Tensor = model(input_ids=ids).logits
    return logits


def _folder_of(module: torch.nn.Module) -> Path | None:
    """The folder a Hugging Face model was loaded from (its tokenizer's), or None: unknown."""
    from raymesh.train import hf  # a causal LM's: transformers is there

    try:
        return hf.folder_of(module)
    except ValueError:
        return None


def _is_causal_lm(module: torch.nn.Module | None) -> bool:
    """Whether `module` is a transformers causal LM (or a PEFT model on one)."""
    get_base: Any = getattr(module, "get_base_model", None)  # a PEFT model's base
    base = get_base() if callable(get_base) else module
    return any(
        c.__module__.startswith("transformers.") and c.__name__.endswith("ForCausalLM")
        for c in type(base).__mro__
    )


def _first_input(task: Task) -> torch.Tensor | None:
    """The input of the task's first sample: the sample itself, or the first item of an
    (input, target) pair; None when there is no dataset or it is not a tensor."""
    if task.dataset is None:
        return None
    try:
        sample = task.dataset[0]
    except Exception:
        return None
    if isinstance(sample, (tuple, list)) and sample:
        sample = sample[0]
    return sample if isinstance(sample, torch.Tensor) else None


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype.is_floating_point:
        return "float64" if dtype == torch.float64 else "float32"
    return "int64"
