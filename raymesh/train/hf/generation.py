"""Serving: `generate`, raymesh.serve's generate function for a causal LM (and the default of
`raymesh serve --hf FOLDER`); and what a replica's batched decoding of these models is made of
(`KVBatch`, `TextPieces`, `next_logits`, `tokenizer_of`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from raymesh.train.hf.models import folder_of, load_tokenizer

__all__ = [
    "KVBatch",
    "TextPieces",
    "choose",
    "generate",
    "next_logits",
    "prompt_ids",
    "tokenizer_of",
]


@functools.lru_cache(maxsize=8)
def _tokenizer_of(folder: Path) -> Any:
    return load_tokenizer(folder)


def tokenizer_of(model: torch.nn.Module) -> Any:
    """The tokenizer of `model`'s folder (the base's, for an adapter); loaded once."""
    return _tokenizer_of(folder_of(model))


def prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A prompt's token ids as `generate` counts them: no special tokens, at least one (eos)."""
    ids: list[int] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return ids or [tokenizer.eos_token_id]


class TextPieces:
    """One sequence's text, a piece per token made: `add(token, last)` is the text the token
    adds ("" for a token that ends no character: its piece comes with the rest, or with the
    last token); `rest()` is what was held back (the piece of an eos)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.made: list[int] = []
        self.text = self.sent = ""  # the text of the tokens made, and of the pieces given

    def add(self, token: int, last: bool) -> str:
        self.made.append(token)
        self.text = self.tokenizer.decode(self.made, skip_special_tokens=True)
        if self.text.endswith("\ufffd") and not last:
            return ""  # a character cut between tokens
        piece, self.sent = self.text[len(self.sent) :], self.text
        return piece

    def rest(self) -> str:
        return self.text[len(self.sent) :]


def choose(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    """The next token from one sequence's logits [V]: the argmax at temperature 0, else drawn
    with `generator` (the sequence's own) from softmax(logits / temperature)."""
    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def generate(
    model: torch.nn.Module, prompt: str, max_tokens: int, temperature: float, seed: int
) -> Iterator[str]:
    """raymesh.serve's generate function for these models: up to `max_tokens` tokens after
    `prompt`, one text piece each (a token that ends no character yields "", still one
    token; the last piece gives what is left), stopping at eos. Temperature 0 is greedy;
    otherwise sampling is seeded with `seed`. The tokenizer is the model's folder's (the
    base's, for an adapter)."""
    tokenizer = tokenizer_of(model)
    device = next(model.parameters()).device
    ids = prompt_ids(tokenizer, prompt)
    generator = torch.Generator().manual_seed(seed)
    pieces = TextPieces(tokenizer)
    cache_kw = _cache_keyword(model)
    cache = None
    step = torch.tensor([ids], device=device)  # the prompt, then one new token at a time
    with torch.inference_mode():
        for i in range(max_tokens):
            out = model(input_ids=step, use_cache=True, **{cache_kw: cache})
            cache = getattr(out, cache_kw)
            token = choose(out.logits[0, -1].float().cpu(), temperature, generator)
            if token == tokenizer.eos_token_id:
                if rest := pieces.rest():  # the eos token's piece: what was held back
                    yield rest
                return
            yield pieces.add(token, last=i == max_tokens - 1)
            step = torch.tensor([[token]], device=device)


def next_logits(model: torch.nn.Module, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
    """The next-token logits [B, V] (float32, on the CPU) of each token sequence, computed as
    one left-padded batch: padding masked out (`attention_mask`) and each sequence's positions
    counted from its own first token (`position_ids`), so a sequence's logits are its own
    alone, up to the float rounding of batched arithmetic. Recomputes every position (no KV
    cache): a batch whose sequences join and leave between tokens keeps no cache to splice."""
    device = next(model.parameters()).device
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, width - len(s) :] = torch.tensor(s)
        mask[row, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=positions.to(device),
        use_cache=False,
    )
    logits: torch.Tensor = out.logits[:, -1].float().cpu()
    return logits


class KVBatch:
    """The KV cache of a batch of sequences, each row left-padded to one length (masked out):
    a sequence is prefilled alone (`prefill`), then spliced in as a row of its own (`join`);
    rows leave between two steps (`keep`); `step` runs every row's newest token at once, at
    each row's own position. Needs transformers' DynamicCache of plain layers (`join` says
    False to any other, before any row is in: the caller then recomputes, `next_logits`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kw = _cache_keyword(model)
        self.device = next(model.parameters()).device
        self.cache: Any = None  # the rows' cache, once one has joined
        self.lengths: list[int] = []  # each row's tokens in the cache
        # [rows, width]: 0 on the padding; kept only while some row is padded (else every
        # entry is 1: `_mask()`), so a step of unpadded rows builds no mask.
        self.mask: torch.Tensor | None = None

    def _mask(self) -> torch.Tensor:
        if self.mask is not None:
            return self.mask
        width = self.lengths[0] if self.lengths else 0
        return torch.ones((len(self.lengths), width), dtype=torch.long)

    def _set_mask(self, mask: torch.Tensor) -> None:
        self.mask = None if bool(mask.all()) else mask

    def prefill(self, ids: Sequence[int]) -> tuple[torch.Tensor, Any]:
        """One sequence alone: the next token's logits [V] after `ids`, and its cache."""
        out = self.model(input_ids=torch.tensor([list(ids)], device=self.device), use_cache=True)
        return out.logits[0, -1].float().cpu(), getattr(out, self.kw)

    def join(self, cache: Any, length: int) -> bool:
        """Splice a prefilled sequence's `cache` (`length` tokens) in as the last row; False,
        with nothing changed, where the cache cannot be spliced."""
        from transformers.cache_utils import DynamicLayer

        layers = getattr(cache, "layers", None)
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            return False
        if self.cache is None:
            self.cache, self.mask, self.lengths = cache, None, [length]
            return True
        mask, ones = self._mask(), torch.ones((1, length), dtype=torch.long)
        width = max(mask.shape[1], length)
        for mine, theirs in zip(self.cache.layers, layers, strict=True):
            mine.keys = torch.cat([_left_pad(mine.keys, width), _left_pad(theirs.keys, width)])
            mine.values = torch.cat(
                [_left_pad(mine.values, width), _left_pad(theirs.values, width)]
            )
        self._set_mask(torch.cat([_left_pad(mask, width, -1), _left_pad(ones, width, -1)]))
        self.lengths.append(length)
        return True

    def keep(self, rows: list[int]) -> None:
        """Keep only `rows` (in that order); padding that no row needs any more goes."""
        if not rows:
            self.cache, self.mask, self.lengths = None, None, []
            return
        mask = self._mask()
        self.lengths = [self.lengths[r] for r in rows]
        cut = mask.shape[1] - max(self.lengths)
        index = torch.tensor(rows)
        for layer in self.cache.layers:
            layer.keys = layer.keys[index.to(layer.keys.device), :, cut:]
            layer.values = layer.values[index.to(layer.values.device), :, cut:]
        self._set_mask(mask[index, cut:])

    def step(self, tokens: Sequence[int]) -> torch.Tensor:
        """Each row's next-token logits [rows, V] (float32, on the CPU) after its `tokens`
        entry, which joins its cache."""
        mask, positions = None, None  # unpadded: the model's own mask and positions are these
        if self.mask is not None:
            self.mask = torch.cat(
                [self.mask, torch.ones((len(tokens), 1), dtype=torch.long)], dim=1
            )
            mask = self.mask.to(self.device)
            positions = torch.tensor([[n] for n in self.lengths], device=self.device)
        out = self.model(
            input_ids=torch.tensor([[t] for t in tokens], device=self.device),
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.kw: self.cache},
        )
        self.cache = getattr(out, self.kw)
        self.lengths = [n + 1 for n in self.lengths]
        logits: torch.Tensor = out.logits[:, -1].float().cpu()
        return logits


def _left_pad(t: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """`t` with zeros before its entries along `dim`, to `width` of them."""
    missing = width - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _cache_keyword(model: torch.nn.Module) -> str:
    """The name of the forward argument (and output field) carrying the KV cache: `cache` in
    newer transformers, `past_key_values` before (deprecated since)."""
    get_base: Any = getattr(model, "get_base_model", None)  # a PEFT model's base
    base = get_base() if callable(get_base) else model
    params = inspect.signature(base.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
