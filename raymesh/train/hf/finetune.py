"""The fine-tuning job: `build`, the build function a job file names
(`build = "raymesh.train.hf:build"`), its `ctx.params` (`Params`) and its loss
(`causal_lm_loss`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from raymesh._common import bad, check_int, from_table
from raymesh.train.hf.models import Lora, folder_of, load_causal_lm, load_tokenizer
from raymesh.train.hf.text import PackedText, packed_text, python_text
from raymesh.train.hf.weights import PretrainedWeights
from raymesh.train.task import Context, Task

__all__ = ["Params", "build", "causal_lm_loss"]


def causal_lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy over `batch` (LongTensor [B, T]): the model shifts
    the labels itself."""
    loss: torch.Tensor = model(input_ids=batch, labels=batch).loss
    return loss


@dataclass(frozen=True, kw_only=True)
class Params:
    """`build`'s `ctx.params` (a job file's [params]), checked: a bad one raises ValueError
    naming `params.<key>`; an unknown key lists the known ones."""

    model: str  # the folder of a causal LM (save_pretrained's): nothing is downloaded
    lora_r: int = 0  # 0: a full fine-tune; >= 1: a LoRA adapter of this rank on a frozen base
    lora_alpha: int | None = None  # default 2 * lora_r
    lora_dropout: float | None = None  # default 0.0
    lora_targets: tuple[str, ...] | None = None  # default ("q_proj", "v_proj")
    lr: float | None = None  # AdamW's; default 1e-3 with LoRA, 1e-4 for a full fine-tune
    weight_decay: float = 0.0
    block_size: int = 128  # tokens per sample
    text: str | None = None  # a UTF-8 text file; None: python_text()
    eval_fraction: float = 0.05  # the last blocks, held out as Task.eval_dataset (0: none)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise bad("params.model", self.model, "give the model's folder")
        check_int("params.lora_r", self.lora_r, minimum=0)
        if isinstance(self.lora_targets, list):  # TOML gives a list
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.lora_r == 0:
            for key in ("lora_alpha", "lora_dropout", "lora_targets"):
                if getattr(self, key) is not None:
                    raise bad(f"params.{key}", getattr(self, key), "LoRA needs lora_r >= 1")
        else:
            self.lora()  # checks alpha, dropout and targets
        for key, low in (("lr", "> 0"), ("weight_decay", ">= 0"), ("eval_fraction", "in [0, 1)")):
            value = getattr(self, key)
            if key == "lr" and value is None:
                continue
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = number and (value > 0 if key == "lr" else value >= 0)
            if not ok or (key == "eval_fraction" and value >= 1):
                raise bad(f"params.{key}", value, f"give a number {low}")
        check_int("params.block_size", self.block_size, minimum=2)
        if self.text is not None and not Path(self.text).is_file():
            raise bad("params.text", self.text, "give a UTF-8 text file (default: Python's docs)")

    @classmethod
    def of(cls, params: dict[str, Any]) -> Params:
        if "model" not in params:
            raise bad("params.model", None, "give the folder of the model to fine-tune")
        return from_table(cls, params, "params")

    def lora(self) -> Lora | None:
        if self.lora_r == 0:
            return None
        alpha = self.lora_alpha if self.lora_alpha is not None else 2 * self.lora_r
        targets = self.lora_targets if self.lora_targets is not None else Lora.targets
        try:
            return Lora(
                r=self.lora_r, alpha=alpha, dropout=self.lora_dropout or 0.0, targets=targets
            )
        except ValueError as e:  # named as the job file names it
            raise ValueError(f"params.{str(e).replace('lora.', 'lora_', 1)}") from None

    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else (1e-3 if self.lora_r else 1e-4)


def build(ctx: Context) -> Task:
    """The Task of fine-tuning `ctx.params.model` (see `Params`) on text packed in blocks:
    AdamW over the parameters that require grad only (a frozen base gets no optimizer
    state), the causal LM loss, and the last `eval_fraction` of the blocks as the eval set."""
    params = Params.of(ctx.params)
    # Built on meta: the trainer shards it, then each rank reads only its shards.
    model = load_causal_lm(params.model, lora=params.lora(), meta=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise bad(
            "params.model",
            params.model,
            "nothing in it trains (an adapter folder loads frozen); give its base folder",
        )
    text = python_text() if params.text is None else Path(params.text).read_text("utf-8")
    blocks = packed_text(load_tokenizer(folder_of(model)), text, params.block_size)
    held = max(1, int(len(blocks) * params.eval_fraction)) if params.eval_fraction else 0
    if held >= len(blocks):
        raise bad(
            "params.eval_fraction",
            params.eval_fraction,
            f"leaves none of the {len(blocks)} blocks to train on; give more text or lower it",
        )
    cut = (len(blocks) - held) * params.block_size
    optimizer = torch.optim.AdamW(
        trainable, lr=params.learning_rate(), weight_decay=params.weight_decay
    )
    return Task(
        model=model,
        optimizer=optimizer,
        dataset=PackedText(blocks.tokens[:cut], params.block_size),
        loss_fn=causal_lm_loss,
        eval_dataset=PackedText(blocks.tokens[cut:], params.block_size) if held else None,
        init_weights=PretrainedWeights(folder_of(model), seed=ctx.seed),
    )
