"""Serving: `generate`, raymesh.serve's generate function for a causal LM (and the default of
`raymesh serve --hf FOLDER`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raymesh.train.hf.models import folder_of, load_tokenizer

__all__ = ["generate"]


@functools.lru_cache(maxsize=8)
def _tokenizer_of(folder: Path) -> Any:
    return load_tokenizer(folder)


def generate(
    model: torch.nn.Module, prompt: str, max_tokens: int, temperature: float, seed: int
) -> Iterator[str]:
    """raymesh.serve's generate function for these models: up to `max_tokens` tokens after
    `prompt`, one text piece each (a token that ends no character yields "", still one
    token; the last piece gives what is left), stopping at eos. Temperature 0 is greedy;
    otherwise sampling is seeded with `seed`. The tokenizer is the model's folder's (the
    base's, for an adapter)."""
    tokenizer = _tokenizer_of(folder_of(model))
    device = next(model.parameters()).device
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] or [tokenizer.eos_token_id]
    generator = torch.Generator().manual_seed(seed)
    made: list[int] = []
    text = sent = ""  # the text of the tokens made, and of those yielded
    cache_kw = _cache_keyword(model)
    cache = None
    step = torch.tensor([ids], device=device)  # the prompt, then one new token at a time
    with torch.inference_mode():
        for i in range(max_tokens):
            out = model(input_ids=step, use_cache=True, **{cache_kw: cache})
            cache = getattr(out, cache_kw)
            logits = out.logits[0, -1].float().cpu()
            if temperature == 0:
                token = int(logits.argmax())
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                token = int(torch.multinomial(probs, 1, generator=generator))
            if token == tokenizer.eos_token_id:
                if text != sent:  # the eos token's piece: what was held back, as it is
                    yield text[len(sent) :]
                return
            made.append(token)
            text = tokenizer.decode(made, skip_special_tokens=True)
            if text.endswith("\ufffd") and i < max_tokens - 1:
                yield ""  # a character cut between tokens: its piece comes with the rest
            else:
                yield text[len(sent) :]
                sent = text
            step = torch.tensor([[token]], device=device)


def _cache_keyword(model: torch.nn.Module) -> str:
    """The name of the forward argument (and output field) carrying the KV cache: `cache` in
    newer transformers, `past_key_values` before (deprecated since)."""
    get_base: Any = getattr(model, "get_base_model", None)  # a PEFT model's base
    base = get_base() if callable(get_base) else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
