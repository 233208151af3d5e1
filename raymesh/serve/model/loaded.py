"""`LoadedModel`: the model a replica serves, built in the replica's process from a `ModelSpec`
(`raymesh.serve.model.spec`, which says what each kind of model is and how its checkpoint is
read): it answers a batch of inputs, and, for a model that generates, streams a prompt's text
pieces after checking the prompt fits the model's context (`PromptTooLong`); a Hugging Face
causal LM generating with `raymesh.train.hf:generate` can also decode many prompts as one
batch (`decoder`, `raymesh.serve.model.decoder`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

import torch

from raymesh._common import resolve
from raymesh.serve.model.decoder import BatchDecoder
from raymesh.serve.model.spec import DTYPES, HF_GENERATE, ModelInfo, ModelSpec, PromptTooLong
from raymesh.train import Task
from raymesh.train.checkpoint import (
    load_weights,
)
from raymesh.train.export import from_record, rebuild

__all__ = ["LoadedModel"]


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
        self._causal_lm = causal_lm
        self._hf_generate = spec.generate == HF_GENERATE
        self.dtype = DTYPES[dtype or "float32"]
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

    def decoder(self, max_streams: int) -> BatchDecoder | None:
        """A decoder of up to `max_streams` streams as one batch, or None where this model
        decodes one stream at a time: `max_streams` 1, or a generate function other than
        `raymesh.train.hf:generate` (a user's per-request function cannot be batched), or a
        causal LM whose tokenizer is not known (no folder)."""
        if max_streams < 2 or not (self._causal_lm and self._hf_generate):
            return None
        if self.module is None or self._folder is None:
            return None
        return BatchDecoder(self.module, max_streams, self.check_context)

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
