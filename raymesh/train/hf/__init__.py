"""raymesh.train.hf: fine-tune a Hugging Face causal LM with raymesh.train, fully or as a LoRA
adapter on a frozen base (PEFT). The build function a job file names:

    build = "raymesh.train.hf:build"
    workers = 2
    steps = 100
    global_batch_size = 8
    [params]
    model = "models/tiny-llama"   # a local save_pretrained folder (nothing is downloaded)
    lora_r = 8                    # 0: a full fine-tune
    [checkpoint]
    dir = "runs/lora"

then `raymesh export runs/lora --hf out/lora` writes the adapter (`--merge`: base and adapter
as one model) and `raymesh serve --hf out/lora` serves it (docs/training.md).

The parts work alone too: a tiny Llama saved from a config, with a byte-level tokenizer
(`save_tiny_llama`, for tests and demos), a model loaded in fp32 with LoRA (`load_causal_lm`),
or built on the meta device and filled with each rank's shards only (`PretrainedWeights`),
text packed into blocks (`packed_text`), the loss (`causal_lm_loss`) and token streaming for
raymesh.serve (`generate`; a replica's batched decoding: `KVBatch`, `TextPieces`,
`next_logits`, `choose`, `prompt_ids`, `tokenizer_of`). Models load with
`local_files_only=True`: a folder, never the hub.
Needs transformers (and peft for LoRA): `pip install 'raymesh[hf]'`; raymesh.train itself
does not import this package.
"""

from raymesh.train.hf.finetune import Params, build, causal_lm_loss
from raymesh.train.hf.generation import (
    KVBatch,
    TextPieces,
    choose,
    generate,
    next_logits,
    prompt_ids,
    tokenizer_of,
)
from raymesh.train.hf.models import (
    Lora,
    folder_of,
    has_tokenizer,
    load_causal_lm,
    load_tokenizer,
    save_tiny_llama,
)
from raymesh.train.hf.text import PackedText, packed_text, python_text
from raymesh.train.hf.weights import PretrainedWeights

__all__ = [
    "KVBatch",
    "Lora",
    "PackedText",
    "Params",
    "PretrainedWeights",
    "TextPieces",
    "build",
    "causal_lm_loss",
    "choose",
    "folder_of",
    "generate",
    "has_tokenizer",
    "load_causal_lm",
    "load_tokenizer",
    "next_logits",
    "packed_text",
    "prompt_ids",
    "python_text",
    "save_tiny_llama",
    "tokenizer_of",
]
