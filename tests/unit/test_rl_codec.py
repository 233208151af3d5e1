"""A policy's tokens and the bytes of prompts and completions (`raymesh.rl.codec`): a model
whose vocabulary its codec cannot cover is refused, naming the policy and the fix."""

from __future__ import annotations

import pytest
import torch

from raymesh.examples.tinygpt import TinyGPT
from raymesh.rl.codec import codec_of
from raymesh.train import hf


def test_a_byte_level_policy_reads_bytes_and_one_of_another_vocabulary_is_refused():
    codec = codec_of(TinyGPT(block_size=8, n_layer=1, n_head=1, n_embd=8), "p")
    assert codec.encode(b"hi").tolist() == [104, 105] and codec.decode(torch.tensor([104])) == b"h"
    assert codec.encode(b"").tolist() == [10]  # an empty prompt is a newline
    odd = TinyGPT(block_size=8, n_layer=1, n_head=1, n_embd=8)
    odd.vocab = 300
    with pytest.raises(ValueError, match=r"^policy='p': its model has vocab=300 and no tokenizer"):
        codec_of(odd, "p")


def test_a_tokenizer_with_more_tokens_than_its_model_embeds_is_refused(tmp_path):
    folder = hf.save_tiny_llama(tmp_path / "llama", hidden_size=16, layers=1, heads=2, kv_heads=1)
    model = hf.load_causal_lm(folder)
    codec = codec_of(model, "p")
    assert codec.eos is not None  # the tokenizer's codec: completions end at its <eos>
    assert codec.decode(codec.encode("hé".encode())) == "hé".encode()
    # Another model's tokenizer, two tokens larger, saved beside this one's weights.
    tokenizer = hf.load_tokenizer(folder)
    tokenizer.add_tokens(["<a>", "<b>"])
    tokenizer.save_pretrained(folder)
    with pytest.raises(
        ValueError,
        match=r"^policy='p': the tokenizer in .* has 259 tokens, its "
        r"model embeds 257: save the model's own tokenizer",
    ):
        codec_of(model, "p")
