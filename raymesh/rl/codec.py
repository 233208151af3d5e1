"""Between a policy's tokens and the bytes that prompts, completions and rewards are made of.

A byte-level policy (vocab 256, as raymesh.examples.tinygpt's) reads bytes as tokens. A
transformers causal LM (raymesh.train.hf, LoRA or not) reads its tokenizer's tokens, from the
folder it was loaded from: a prompt is UTF-8 text encoded by the tokenizer, a completion is
decoded back to UTF-8 bytes for the reward, and a completion ends at the tokenizer's
end-of-text token (the tokens after it are masked out of the loss).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Codec", "codec_of", "context_of"]


class Codec:
    """Bytes as tokens (ids 0..255), no end-of-text token."""

    eos: int | None = None

    def encode(self, text: bytes) -> torch.Tensor:
        """The prompt's token ids, a 1-D LongTensor (an empty prompt: a newline)."""
        return torch.tensor(list(text or b"\n"), dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> bytes:
        return bytes(ids.tolist())


class _Tokenizer(Codec):
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id

    def encode(self, text: bytes) -> torch.Tensor:
        ids = self.tokenizer(text.decode("utf-8", "replace") or "\n", add_special_tokens=False)
        return torch.tensor(ids["input_ids"], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> bytes:
        text: str = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        return text.encode("utf-8")


def codec_of(model: torch.nn.Module, policy: Any) -> Codec:
    """The codec of `model` (built by `policy`, named in errors): its tokenizer's when it is a
    transformers model loaded from a folder with one, bytes when its vocabulary is 256;
    ValueError otherwise."""
    if hasattr(model, "config") or hasattr(model, "get_base_model"):  # transformers or PEFT
        from raymesh.train.hf import folder_of, has_tokenizer, load_tokenizer

        folder = folder_of(model)
        if has_tokenizer(folder):
            tokenizer = load_tokenizer(folder)
            embeddings: Any = model.get_input_embeddings  # (transformers' and PEFT's)
            rows = embeddings().num_embeddings
            if len(tokenizer) > rows:  # its last ids would index past the embedding
                raise ValueError(
                    f"policy={policy!r}: the tokenizer in {str(folder)!r} has {len(tokenizer)} "
                    f"tokens, its model embeds {rows}: save the model's own tokenizer beside "
                    "it, or grow its embeddings to the tokenizer "
                    "(model.resize_token_embeddings(len(tokenizer)), then save_pretrained)"
                )
            return _Tokenizer(tokenizer)
        raise ValueError(
            f"policy={policy!r}: its model's folder {str(folder)!r} holds no tokenizer; save "
            "one beside the model (tokenizer.save_pretrained)"
        )
    vocab = getattr(model, "vocab", None)
    if vocab != 256:
        raise ValueError(
            f"policy={policy!r}: its model has vocab={vocab!r} and no tokenizer; give a "
            "byte-level model (vocab = 256, as raymesh.examples.tinygpt's) or a transformers "
            "one (raymesh.train.hf:build)"
        )
    return Codec()


def context_of(model: torch.nn.Module) -> int | None:
    """The most tokens the model sees: its block size, or a transformers model's
    max_position_embeddings; None when it says neither."""
    size = getattr(model, "block_size", None)
    if size is None:
        size = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return size
