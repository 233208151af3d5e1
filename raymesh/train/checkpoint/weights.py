"""A committed checkpoint's model weights outside training: `resolve_checkpoint` finds the step
to read (a run's newest one that verifies, or the step folder given) and `load_weights` puts
its weights into a module, refusing a checkpoint of another model with the keys that differ;
`check_named_paths` keeps what rebuilding its model reads under a root (serve's reloads).

Serving (raymesh.serve) and exporting (raymesh.train.export) both read a checkpoint this way,
one process, no process group.
"""

from __future__ import annotations

from pathlib import Path

import torch

from raymesh.train.checkpoint.checkpointer import Checkpointer, export_state_dict
from raymesh.train.checkpoint.errors import CheckpointError
from raymesh.train.checkpoint.layout import MANIFEST, named_paths, read_manifest

__all__ = ["check_named_paths", "load_weights", "resolve_checkpoint"]

_SHOWN = 3  # mismatching keys named per kind: enough to recognise the model, not a page


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder's newest committed step that verifies, or a step folder itself.
    Raises ValueError naming the path when there is none."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = Checkpointer(path).latest()
    if latest is None:
        raise ValueError(
            f"checkpoint={str(path)!r}: no committed checkpoint there (train one with "
            "`raymesh train job.toml`, or give a step-XXXXXXXX folder)"
        )
    return latest


def load_weights(module: torch.nn.Module, checkpoint: str | Path) -> None:
    """Load the model weights of the step folder `checkpoint` into `module`, strictly: every
    key of the module and of the checkpoint, each at the module's shape. Checksums are
    verified first (`export_state_dict`: CheckpointError if they fail). A checkpoint of another
    model raises ValueError naming the checkpoint and a few of the keys that differ (missing,
    unexpected, or of another shape), before any weight of `module` changes."""
    state = export_state_dict(checkpoint)
    mine = module.state_dict()
    missing = sorted(set(mine) - set(state))
    unexpected = sorted(set(state) - set(mine))
    shapes = sorted(
        f"{k} {list(state[k].shape)} vs {list(mine[k].shape)}"
        for k in set(mine) & set(state)
        if isinstance(state[k], torch.Tensor)
        and isinstance(mine[k], torch.Tensor)
        and state[k].shape != mine[k].shape
    )
    if missing or unexpected or shapes:
        parts = [
            f"{len(keys)} {what} (e.g. {', '.join(keys[:_SHOWN])})"
            for what, keys in (
                ("missing from it", missing),
                ("not in the model", unexpected),
                ("of another shape (checkpoint vs model)", shapes),
            )
            if keys
        ]
        raise ValueError(
            f"checkpoint={str(checkpoint)!r} holds the weights of another model: keys "
            + "; ".join(parts)
            + ". Build the model the checkpoint's job trained (its build function and params)"
        )
    # A module built on the meta device has no storage to copy into: it takes the tensors.
    meta = any(t.is_meta for t in mine.values() if isinstance(t, torch.Tensor))
    module.load_state_dict(state, strict=True, assign=meta)


def check_named_paths(step: str | Path, root: str | Path) -> None:
    """PermissionError, naming the path and `root`, when the manifest of the step folder `step`
    names a file or folder outside `root` (links resolved) in its job's params or its Hugging
    Face record: rebuilding the model reads those (a base model's folder, a text file), and a
    manifest is whatever whoever wrote the folder wrote. Nothing is read but the manifest; one
    that cannot be read names nothing here (loading it fails on its own)."""
    try:
        manifest = read_manifest(Path(step))
    except (CheckpointError, ValueError):
        return
    real_root = Path(root).resolve()
    for named in named_paths(manifest):
        real = Path(named).resolve()
        if not real.is_relative_to(real_root):
            raise PermissionError(
                f"checkpoint={str(step)!r}: its manifest names {named!r} (resolved: "
                f"{str(real)!r}), outside checkpoint_root={str(root)!r}; a reload reads "
                "nothing outside it: move that under the root, or serve this checkpoint from "
                "a new server"
            )
