"""`commit_files`: what makes a written save a checkpoint (rank 0's part of `Checkpointer`'s
commit), and `Commit`, what it needs to know of the save.

Every rank has written its files into the save's `.tmp-*` folder before rank 0 calls it. It then
hashes every file, writes the manifest last and fsyncs it, renames the folder to
`step-XXXXXXXX` in one `os.replace` and fsyncs `dir`: a crash at any point leaves the previous
committed checkpoints or the new one, never a half-written `step-*` folder (the package's
"Atomic" guarantee). Only after the commit does it remove checkpoints past `keep` and stale
`.tmp-*` folders.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymesh.train.checkpoint.layout import (
    MANIFEST,
    TMP_PREFIX,
    Manifest,
    committed_steps,
    sha256,
)

__all__ = ["Commit", "commit_files"]

log = logging.getLogger("raymesh")


@dataclass(frozen=True, kw_only=True)
class Commit:
    """What rank 0 needs to commit a written save."""

    tmp: Path
    step: int
    world_size: int
    strategy: str
    config: dict[str, Any]
    data_position: int
    rank: int
    extra: dict[str, Any]
    hf: dict[str, Any]


def commit_files(commit: Commit, dir: Path, *, keep: int) -> None:
    """Commit the save written into `commit.tmp` as `dir/step-<step:08d>` (see the module
    docstring), replacing a checkpoint of the same step; then keep the newest `keep` committed
    checkpoints and remove every other `.tmp-*` folder. Rank 0 only; raises what the file
    system raises."""
    files = {
        p.relative_to(commit.tmp).as_posix(): sha256(p)
        for p in sorted(commit.tmp.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    manifest = Manifest(
        step=commit.step,
        world_size=commit.world_size,
        strategy=commit.strategy,
        config=commit.config,
        data_position=commit.data_position,
        files=files,
        extra=commit.extra,
        hf=commit.hf,
        created=time.time(),
    )
    with open(commit.tmp / MANIFEST, "w") as f:
        f.write(manifest.to_json())
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(commit.tmp)
    target = dir / f"step-{commit.step:08d}"
    if target.exists():
        # rename(2) cannot replace a non-empty folder: move the old one aside (to a .tmp-
        # name, so a crash right here leaves only litter that the next commit removes).
        os.replace(target, dir / f"{TMP_PREFIX}replaced-{target.name}-{uuid.uuid4().hex}")
    os.replace(commit.tmp, target)
    _fsync_dir(dir)
    log.info("checkpoint: committed %s", target)
    committed = sorted(committed_steps(dir), reverse=True)
    for _, old in committed[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    # At most one save is in flight and it is this one, so every other .tmp-* is stale.
    for entry in dir.iterdir():
        if entry.name.startswith(TMP_PREFIX):
            shutil.rmtree(entry, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its folder's entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
