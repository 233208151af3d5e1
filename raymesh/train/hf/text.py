"""Text to train on: Python's own help text (`python_text`), tokenized and packed into
fixed-length blocks (`packed_text`, `PackedText`: a map-style dataset)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from raymesh._common import bad, check_int

__all__ = ["PackedText", "packed_text", "python_text"]


def python_text() -> str:
    """Text that ships with Python: the topics of its help (`pydoc_data.topics`), in sorted
    order (the same text every call)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


class PackedText(torch.utils.data.Dataset[torch.Tensor]):
    """A token stream cut into `block_size` blocks, contiguous and non-overlapping: item i is
    tokens [i * block_size, (i + 1) * block_size) as a LongTensor; the tail that fills no
    block is left out. ValueError when `block_size` < 2 or no block fits."""

    def __init__(self, ids: Sequence[int] | torch.Tensor, block_size: int) -> None:
        check_int("block_size", block_size, minimum=2)
        tokens = torch.as_tensor(ids, dtype=torch.long)
        if tokens.dim() != 1:
            raise bad("ids", f"a tensor of shape {list(tokens.shape)}", "give one token stream")
        if len(tokens) < block_size:
            raise bad(
                "block_size",
                block_size,
                f"the text has {len(tokens)} tokens, not one block; give more text or a "
                "smaller block_size",
            )
        self.block_size = block_size
        self.tokens = tokens[: len(tokens) // block_size * block_size].contiguous()

    def __len__(self) -> int:
        return len(self.tokens) // self.block_size

    def __getitem__(self, index: int) -> torch.Tensor:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"block {index} of {n}")
        start = (index % n) * self.block_size
        # A copy: a view would carry (and pickle) the whole stream with it.
        return self.tokens[start : start + self.block_size].clone()


_PIECE = 1 << 16  # characters tokenized at once (see packed_text)


def packed_text(tokenizer: Any, text: str | Sequence[str], block_size: int) -> PackedText:
    """`text` tokenized (no special tokens added; documents, when it is a list, joined with
    the eos token) and packed into blocks of `block_size`.

    A document is tokenized in pieces of about 64 Ki characters, each cut after a line end:
    a fast tokenizer's encoding of a whole 1.5 MB text (its tokens, offsets and masks) took
    about 80 MB on every rank at once. The tokens are the whole text's wherever the tokenizer
    does not merge across a line end (byte-level BPE's pre-tokenizer splits there)."""
    docs = [text] if isinstance(text, str) else list(text)
    ids: list[int] = []
    for i, doc in enumerate(docs):
        if i:
            ids.append(tokenizer.eos_token_id)
        start = 0
        while start < len(doc):
            cut = doc.find("\n", start + _PIECE)
            end = len(doc) if cut < 0 else cut + 1
            ids += tokenizer(
                doc[start:end], add_special_tokens=False, return_attention_mask=False, verbose=False
            )["input_ids"]
            start = end
    return PackedText(ids, block_size)
