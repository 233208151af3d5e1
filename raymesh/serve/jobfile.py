"""A served model from a TOML job file (`raymesh serve job.toml`): the training job's own file,
with an optional `[serve]` table of deploy's arguments and ServeConfig's fields:

    build = "raymesh.examples.tinygpt:build"     # the model, built as training built it
    [checkpoint]
    dir = "runs/tinygpt"                         # the weights served: its newest checkpoint

    [serve]
    generate = "raymesh.examples.tinygpt:serve_text"   # serves POST /v1/generate
    replicas = [1, 4]                                  # autoscale between 1 and 4
    max_batch_size = 32
    batch_wait_ms = 5
    checkpoint_root = "runs"                 # POST /admin/reload loads only from under it
    tls = {cert = "cert.pem", key = "key.pem"}         # HTTPS

A job whose build function cannot be imported here (one of the user's script) serves its
checkpoint alone: a transformers (or PEFT) model is rebuilt from what its checkpoint records
(`raymesh.serve.model`). Or, for a fine-tuned Hugging Face model, the folder `raymesh export
RUN --hf OUT` wrote:

    [serve]
    hf = "out/finetune"      # served instead of the build function and its checkpoint

Tokens are best left out of the file: $RAYMESH_SERVE_TOKEN and $RAYMESH_SERVE_ADMIN_TOKEN.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from raymesh._common import read_toml, split_job
from raymesh.serve.config import ServeConfig
from raymesh.train import load_config
from raymesh.train.export import rebuild_plan

__all__ = ["MODEL_KEYS", "load_serving"]

MODEL_KEYS = ("generate", "input_shape", "input_dtype")  # deploy's model arguments


def load_serving(path: str | Path, **overrides: Any) -> tuple[dict[str, Any], ServeConfig]:
    """deploy's model arguments (build, checkpoint, seed, and MODEL_KEYS from [serve]) and the
    ServeConfig, with `overrides` (None values skipped) on top of the file's. The job's build
    is left out when it does not import here and a checkpoint is served: the checkpoint alone
    then says how to rebuild its model (deploy refuses one that cannot, naming it). Raises
    ValueError naming the file and the field."""
    path = Path(path)
    _, tables = split_job(read_toml(path))  # other commands' tables ([tune]) are skipped
    table = tables.get("serve", {})
    if not isinstance(table, dict):
        raise ValueError(f"{path}: serve must be a table ([serve])")
    hf = table.pop("hf", None)
    model: dict[str, Any] = {k: table.pop(k) for k in MODEL_KEYS if k in table}
    if "input_shape" in model:
        model["input_shape"] = tuple(model["input_shape"])
    checkpoint = overrides.pop("checkpoint", None)
    if hf is not None:  # an exported folder: its own weights, no build function to run
        if not isinstance(hf, str) or not hf:
            raise ValueError(
                f"{path}: serve.hf={hf!r}: give the folder `raymesh export --hf` wrote"
            )
        model.update(hf=hf)  # relative to the working directory, as [checkpoint] dir is
        if checkpoint is not None:
            model.update(checkpoint=checkpoint)  # refused by deploy, with the fix
    else:
        job = load_config(path)
        if checkpoint is None and job.checkpoint is not None:
            checkpoint = job.checkpoint.dir
        if job.build is None and checkpoint is None:
            raise ValueError(
                f'{path}: set build = "module:function" in the job file, or name a checkpoint '
                "([checkpoint] dir, or --checkpoint) of a model it records"
            )
        # Where a checkpoint is served, its job's build runs only where it imports here (the
        # one decision, as an export makes it); else the checkpoint alone says how.
        if job.build is not None and (
            checkpoint is None or rebuild_plan(None, named=job.build) is not None
        ):
            model.update(build=job.build)  # the model, built as training built it
        model.update(checkpoint=checkpoint, seed=job.seed)
    table.update({k: v for k, v in overrides.items() if v is not None})
    try:
        config = ServeConfig.from_dict(table)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return model, config
