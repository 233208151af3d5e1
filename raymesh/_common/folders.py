"""Writing a new folder whole or not at all, a file replaced whole, and lines appended whole."""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = ["append_lines", "new_folder", "replace_text"]


@contextlib.contextmanager
def new_folder(path: Path) -> Iterator[Path]:
    """A temporary sibling of `path` to write into; renamed to `path` in one `os.replace` when
    the block ends, removed when it raises, so `path` holds the whole folder or nothing.
    `os.replace` fails on a folder that is not empty: the caller checks what may stand at
    `path` (a check at the end of the block sees anything made meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:12]}"
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def append_lines(path: Path, text: str) -> None:
    """Append `text` (whole lines) to `path` in one `write`, making its folder if need be: a
    concurrent reader that keeps only complete lines never sees a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(text)


def replace_text(path: Path, text: str) -> None:
    """Replace the file `path` with `text` in one `os.replace` of a synced temporary sibling:
    a reader, or a crash, sees the old file or the new one, never a part."""
    tmp = path.parent / f".tmp-{path.name}-{uuid.uuid4().hex[:12]}"
    try:
        with tmp.open("w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
