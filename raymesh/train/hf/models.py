"""The model side: a tiny Llama saved from a config (`save_tiny_llama`, with a byte-level
tokenizer), a causal LM loaded from a local folder in fp32, with a new LoRA adapter or a saved
one (`load_causal_lm`), its tokenizer (`load_tokenizer`), and the folder a loaded model came
from (`folder_of`). Nothing is downloaded: every load is `local_files_only`.

Weights are read from safetensors only (`use_safetensors=True`): a folder whose weights are a
pickle (`pytorch_model.bin`, `adapter_model.bin`) is refused before anything in it is read, as
unpickling one can run code whatever torch.load's guard (CVE-2025-32434 bypassed it).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

from raymesh._common import bad, check_int, new_folder

__all__ = [
    "EOS",
    "Lora",
    "folder_of",
    "has_tokenizer",
    "load_causal_lm",
    "load_tokenizer",
    "save_tiny_llama",
]

EOS = "<eos>"  # the tiny model's end-of-text token (id 256, after the bytes)
# `dtype` replaced `torch_dtype` in transformers 4.56; older ones know only the latter.
_NEW_DTYPE = tuple(map(int, transformers.__version__.split(".")[:2])) >= (4, 56)
_DTYPE_KW = "dtype" if _NEW_DTYPE else "torch_dtype"

# PEFT asks transformers' deprecated `is_gradient_checkpointing` on every adapted model, and each
# rank would print the FutureWarning: it is theirs to move, not the user's.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


@dataclass(frozen=True, kw_only=True)
class Lora:
    """A LoRA adapter to train on a frozen base (PEFT's LoraConfig, the common fields)."""

    r: int = 8  # rank of the update matrices
    alpha: int = 16  # scale: the update is multiplied by alpha / r
    dropout: float = 0.0  # dropout on the adapter's input, in training
    targets: tuple[str, ...] = ("q_proj", "v_proj")  # module names (or name suffixes) to adapt

    def __post_init__(self) -> None:
        check_int("lora.r", self.r, minimum=1)
        number = isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool)
        if not number or self.alpha <= 0:
            raise bad("lora.alpha", self.alpha, "give a number > 0 (2 * r is usual)")
        number = isinstance(self.dropout, (int, float)) and not isinstance(self.dropout, bool)
        if not number or not 0 <= self.dropout < 1:
            raise bad("lora.dropout", self.dropout, "give a probability in [0, 1)")
        targets = self.targets
        if isinstance(targets, list):
            targets = tuple(targets)
        if not isinstance(targets, tuple) or not targets:
            raise bad("lora.targets", self.targets, 'give module names, e.g. ["q_proj", "v_proj"]')
        if not all(isinstance(t, str) and t for t in targets):
            raise bad("lora.targets", self.targets, "give non-empty module names (strings)")
        object.__setattr__(self, "targets", targets)


def save_tiny_llama(
    path: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position: int = 512,
    seed: int = 0,
) -> Path:
    """Save a small Llama-architecture causal LM, built from a config (nothing downloaded), and
    a byte-level tokenizer (token i is byte i, plus `<eos>`) into the new folder `path`;
    returns it. Deterministic: the same arguments write the same bytes (the weights are drawn
    after `torch.manual_seed(seed)`, leaving the caller's random state as it was).

    Atomic: built in a temporary sibling, renamed into place. ValueError when `path` exists
    and is not an empty folder (it is never overwritten)."""
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        raise bad("path", str(path), "it exists and is not an empty folder; give a new one")
    tokenizer = _byte_tokenizer()
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config)
    with new_folder(path) as tmp:  # onto nothing, or onto an empty folder
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return path


def _byte_tokenizer() -> Any:
    """Bytes as tokens, ids 0..255 equal to the byte values (GPT-2's byte-to-character map, as
    the ByteLevel pre-tokenizer applies it), and `<eos>` = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    char = {b: chr(b) for b in printable}
    rest = [b for b in range(256) if b not in char]
    char.update({b: chr(256 + i) for i, b in enumerate(rest)})
    vocab = {char[b]: b for b in range(256)} | {EOS: 256}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def has_tokenizer(path: str | Path) -> bool:
    """Whether the folder holds a tokenizer's files."""
    return any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer saved in the folder `path` (no download); ValueError naming the folder
    when it holds none."""
    if not has_tokenizer(path):
        raise bad(
            "tokenizer",
            str(path),
            "no tokenizer files (tokenizer.json, tokenizer_config.json) in this folder; save "
            "one there with tokenizer.save_pretrained(folder)",
        )
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_causal_lm(
    path: str | Path, *, lora: Lora | None = None, meta: bool = False
) -> torch.nn.Module:
    """The causal LM saved in the folder `path` (no download), in fp32 (the master weights:
    mixed precision is the trainer's job), with its KV cache off (training never uses it, and
    activation checkpointing recomputes layers, which a cache would corrupt).

    meta: build it from the folder's config with its parameters on the meta device (no memory,
        nothing read; computed buffers such as rotary frequencies are real), for a
        `Task(init_weights=PretrainedWeights(path))` that reads each rank's shards once the
        trainer has sharded it. A LoRA adapter is added on meta too.

    lora: wrap it in a new LoRA adapter (PEFT): only the adapter's weights require grad.
        ValueError naming `targets` when a target matches no module, listing the model's
        Linear module names.
    A PEFT adapter folder (adapter_config.json naming a local base folder) loads as its base
    with the adapter, frozen (for serving). ValueError naming the folder when it is no model.
    """
    path = Path(path).absolute()  # the name the model keeps: found again from any directory
    if not path.is_dir():
        raise bad("model", str(path), "no such folder; give a save_pretrained folder")
    if (path / "adapter_config.json").is_file() and not (path / "config.json").is_file():
        if lora is not None:
            raise bad("lora", lora, "this folder is an adapter already; give its base folder")
        return _load_adapter(path)
    if not (path / "config.json").is_file():
        raise bad(
            "model",
            str(path),
            "not a model folder (no config.json); save one with model.save_pretrained(folder) "
            "or raymesh.train.hf.save_tiny_llama(folder)",
        )
    _check_safetensors(path, "model.safetensors")
    if meta:
        from accelerate import init_empty_weights  # parameters on meta, buffers real

        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        with init_empty_weights():
            model = transformers.AutoModelForCausalLM.from_config(
                config, **{_DTYPE_KW: torch.float32}
            )
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path), local_files_only=True, use_safetensors=True, **{_DTYPE_KW: torch.float32}
        )
    model.config.use_cache = False
    if lora is None:
        return model
    import peft

    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    names = [n for n, _ in model.named_modules()]
    unmatched = [t for t in lora.targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise bad(
            "targets",
            list(lora.targets),
            f"{unmatched} match no module of the model; its Linear modules are {linear}",
        )
    config = peft.LoraConfig(
        r=lora.r,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, config)


def _load_adapter(path: Path) -> torch.nn.Module:
    import peft

    base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not Path(base).is_dir():
        raise bad(
            "model",
            str(path),
            f"this adapter's base_model_name_or_path={base!r} is not a local folder; give the "
            "full model (raymesh export --merge), or fix adapter_config.json",
        )
    # PEFT has no use_safetensors: it falls back to adapter_model.bin, so it is refused here.
    _check_safetensors(path, "adapter_model.safetensors")
    return peft.PeftModel.from_pretrained(load_causal_lm(base), str(path))


def _check_safetensors(path: Path, name: str) -> None:
    """Refuse a folder whose weights are not safetensors (ValueError naming it and the fix):
    `name` for an adapter, any `*.safetensors` (one file or shards) for a model."""
    found = (
        (path / name).is_file() if name.startswith("adapter") else any(path.glob("*.safetensors"))
    )
    if found:
        return
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    held = f"its weights are {pickles}, a pickle" if pickles else f"it holds no {name}"
    raise bad(
        "model",
        str(path),
        f"{held}; raymesh reads safetensors only (unpickling can run code). Convert it where "
        "you trust the file: load it and save_pretrained(folder) writes safetensors",
    )


def folder_of(model: torch.nn.Module) -> Path:
    """The folder the (base) model was loaded from."""
    get_base: Any = getattr(model, "get_base_model", None)  # a PEFT model's base
    base = get_base() if callable(get_base) else model
    config = getattr(base, "config", None)
    name = getattr(base, "name_or_path", "") or getattr(config, "_name_or_path", "")
    if not name or not Path(name).is_dir():
        raise ValueError(
            f"the model names no folder it was loaded from (name_or_path={name!r}); load it "
            "with raymesh.train.hf.load_causal_lm(folder)"
        )
    return Path(name)
