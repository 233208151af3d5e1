"""Runs of raymesh.train.hf's build function made in this process, for the export and serve
tests: one optimizer step, saved by the training checkpointer (one process, no process group),
with a manifest naming the build function and its params, as `raymesh train` writes it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from raymesh.train import Context, Task, TrainConfig
from raymesh.train.checkpoint import Checkpointer

HF_BUILD = "raymesh.train.hf:build"
TEXT = "The quick brown fox jumps over the lazy dog. " * 40  # 1800 tokens: 28 blocks of 64


def text_file(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "text.txt"
    path.write_text(TEXT)
    return path


def job(model: Path, text: Path, **params: Any) -> TrainConfig:
    """The config of a one-rank hf.build job on `model` and `text`, blocks of 64 tokens."""
    params = {"model": str(model), "text": str(text), "block_size": 64, **params}
    return TrainConfig(build=HF_BUILD, seed=0, global_batch_size=4, params=params)


def built(config: TrainConfig) -> Task:
    """hf.build's Task for `config`, as a rank of one builds it (torch seeded first), its
    model filled from the pretrained weights."""
    from raymesh.train import hf
    from raymesh.train.materialize import materialize

    torch.manual_seed(config.seed)
    ctx = Context.alone(seed=config.seed, config=config)
    task = hf.build(ctx)
    materialize(task.model, ctx.device, task.init_weights, task.optimizer)
    return task


def trained_run(dir: Path, config: TrainConfig, model: torch.nn.Module | None = None) -> Task:
    """`config`'s Task after one optimizer step on its first 4 blocks, checkpointed as step 1 in
    `dir`; `model`: save that module's weights instead (a checkpoint of another model)."""
    task = built(config)
    saved = model if model is not None else task.model
    optimizer = torch.optim.AdamW(saved.parameters()) if model is not None else task.optimizer
    return step_and_save(task, dir, config, saved, optimizer)


def step_and_save(
    task: Task,
    dir: Path,
    config: TrainConfig,
    saved: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Task:
    """One optimizer step of `task` on its first 4 samples, then `saved` (default: its model)
    checkpointed as step 1 in `dir` with `config` as the job's, as a rank saves it."""
    batch = torch.stack([task.dataset[i] for i in range(4)])
    task.loss_fn(task.model, batch).backward()
    task.optimizer.step()
    task.optimizer.zero_grad()
    saved = saved if saved is not None else task.model
    optimizer = optimizer if optimizer is not None else task.optimizer
    Checkpointer(dir, keep=1).save(
        1,
        saved,
        optimizer,
        world_size=1,
        strategy="ddp",
        config=config.to_dict(),
        data_position=0,
        rank=0,
    )
    return task


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.inference_mode():
        out: torch.Tensor = model(input_ids=ids).logits
    return out
