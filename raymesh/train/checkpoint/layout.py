"""The on-disk layout of a checkpoint folder, its manifest, and the check that a folder holds
what its manifest says (the layout itself is drawn in raymesh.train.checkpoint's docstring).

A `step-XXXXXXXX` folder is committed; a `.tmp-*` one is a save in progress (or left by a
crash) and never read. `manifest.json`, written last, lists every other file with its sha256;
`verify` recomputes them, and reads `.metadata` as a load would, before anything is loaded.

What `verify` reads is bounded, whoever wrote the folder: every file it opens is a regular file
whose real path lies inside the step folder (a link to `/dev/zero`, a FIFO, or a file outside is
refused from its `stat`, unread: reading one would never end, or read what the folder does not
hold), the manifest is at most `MAX_MANIFEST_BYTES`, and every file `.metadata` sends DCP to is
one the manifest lists (no `../` or absolute path out of the folder). A step folder that is a
link to anything but a folder is no checkpoint; where a step folder may lie is its reader's
rule (serve's reloads: under checkpoint_root).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymesh.train.checkpoint.errors import CheckpointError
from raymesh.train.checkpoint.unpickling import data_files, read_metadata

__all__ = [
    "FORMAT",
    "MANIFEST",
    "MAX_MANIFEST_BYTES",
    "MODEL",
    "OPTIM",
    "STEP_DIR",
    "TMP_PREFIX",
    "Manifest",
    "named_paths",
    "read_manifest",
]

MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 64 << 20  # a job's config and a file list: far below; a bound, not a size
FORMAT = 1  # manifest format this module writes and reads
STEP_DIR = re.compile(r"^step-(\d+)$")
TMP_PREFIX = ".tmp-"
# The keys of the saved state: {"model": model_state_dict, "optim": optim_state_dict}. DCP
# flattens nested dicts, so model entries are stored as "model.<fqn>" (e.g. "model.0.weight").
MODEL = "model"
OPTIM = "optim"


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What a committed checkpoint holds; `manifest.json` in its folder."""

    step: int  # optimizer steps done when it was saved (the folder is step-<step:08d>)
    world_size: int  # ranks that saved it (loading at another world size reshards)
    strategy: str  # how the model was wrapped when saved: "ddp", "fsdp" or "hsdp"
    config: dict[str, Any]  # the job's config (TrainConfig.to_dict()), JSON data
    data_position: int  # the next step of the global sample order (raymesh.data.order)
    files: dict[str, str]  # relative path -> sha256 hex of every other file in the folder
    created: float  # time.time() at commit
    format: int = FORMAT  # manifest format; a newer one is refused rather than misread
    # The saver's own state, JSON data (raymesh.rl: the RL loop's position in its samples);
    # a manifest written before it existed reads as {}
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # What rebuilds a Hugging Face model without its build function (`hf_record`'s: the
    # model's class and config, a PEFT adapter's config, the base folder); {} for other models
    hf: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        """Parse and check a manifest; ValueError (naming what is wrong) if it is not one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        missing = sorted(names - {"format", "extra", "hf"} - set(data))
        unknown = sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(f"missing field(s) {missing}, unknown field(s) {unknown}")
        fmt = data.get("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"format={fmt!r}: this raymesh reads format {FORMAT} only")
        checks: dict[str, type | tuple[type, ...]] = {
            "step": int,
            "world_size": int,
            "strategy": str,
            "config": dict,
            "data_position": int,
            "files": dict,
            "created": (int, float),
            "extra": dict,
            "hf": dict,
        }
        data.setdefault("extra", {})
        data.setdefault("hf", {})
        for name, kind in checks.items():
            if not isinstance(data[name], kind) or isinstance(data[name], bool):
                raise ValueError(f"{name}={data[name]!r}: wrong type")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["files"].items()):
            raise ValueError("files: expected {relative path: sha256 hex}")
        return cls(**data)


def committed_steps(dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step-* folder in `dir`, valid or not."""
    out = []
    for entry in dir.iterdir():
        match = STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            out.append((int(match.group(1)), entry))
    return out


def verify(path: Path) -> Manifest:
    """The manifest of the checkpoint at `path` if every file it lists is there with its
    checksum and its `.metadata` holds DCP metadata only, naming files the manifest lists;
    CheckpointError naming the first problem otherwise. Nothing but regular files inside the
    folder is opened (see the module), so it returns or raises promptly whatever is there."""
    if not path.is_dir():  # stat only: a link to /dev/zero is no folder
        raise CheckpointError(f"{str(path)!r} is not a folder")
    real = path.resolve()
    if not (path / MANIFEST).exists() and not (path / MANIFEST).is_symlink():
        raise CheckpointError("no manifest.json (a partial or interrupted save)")
    try:
        manifest = read_manifest(path)
    except ValueError as e:
        raise CheckpointError(f"manifest.json is invalid: {e}") from None
    match = STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest.step:
        raise CheckpointError(f"manifest.json says step {manifest.step}, the folder name differs")
    if ".metadata" not in manifest.files:
        raise CheckpointError("manifest.json lists no DCP .metadata file")
    for rel, expected in sorted(manifest.files.items()):
        file = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"manifest.json lists a path outside the folder: {rel!r}")
        try:
            _check_regular(file, real, rel)
            actual = sha256(file)
        except FileNotFoundError:
            raise CheckpointError(f"file {rel!r} is missing") from None
        if actual != expected:
            raise CheckpointError(
                f"file {rel!r} fails its checksum (sha256 {actual[:12]}..., "
                f"manifest {expected[:12]}...): corrupt"
            )
    # Its checksum matching proves nothing about who wrote it: read it as DCP will, refusing
    # anything but metadata, so that a checkpoint that would be refused is never `latest()`.
    with open(path / ".metadata", "rb") as stream:
        metadata = read_metadata(stream, ".metadata")
    for rel in sorted(data_files(metadata) - set(manifest.files)):
        raise CheckpointError(
            f".metadata sends DCP to {rel!r}, which manifest.json does not list: refused"
        )
    return manifest


def read_manifest(path: Path) -> Manifest:
    """The parsed manifest of the step folder `path`, read only if it is a regular file inside
    the folder of at most MAX_MANIFEST_BYTES: CheckpointError otherwise, ValueError (naming
    what is wrong) when it is no manifest."""
    file = path / MANIFEST
    try:
        _check_regular(file, path.resolve(), MANIFEST)
        with open(file, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise CheckpointError("no manifest.json (a partial or interrupted save)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read manifest.json: {e}") from None
    if len(data) > MAX_MANIFEST_BYTES:
        raise CheckpointError(f"manifest.json is over {MAX_MANIFEST_BYTES} bytes: not a manifest")
    return Manifest.from_json(data.decode("utf-8", errors="replace"))


def named_paths(manifest: Manifest) -> list[str]:
    """The strings of the job's `params` (nested ones too) and of its Hugging Face record (the
    base folder) that name an existing file or folder, as written: what rebuilding the model
    may read besides the checkpoint (the reloader keeps them under its root)."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, str):
            if value and os.path.lexists(value) and value not in found:
                found.append(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(manifest.config.get("params"))
    walk(manifest.hf.get("base"))
    return found


def _check_regular(file: Path, real_folder: Path, rel: str) -> None:
    """CheckpointError unless `file` is a regular file (links followed, by stat: nothing is
    opened) whose real path is inside `real_folder`. FileNotFoundError when it is absent."""
    mode = os.stat(file).st_mode
    if not stat.S_ISREG(mode):
        raise CheckpointError(
            f"{rel!r} is not a regular file (a device, FIFO or folder, or a link to one): "
            "refused unread"
        )
    if not file.resolve().is_relative_to(real_folder):
        raise CheckpointError(
            f"{rel!r} links to {str(file.resolve())!r}, outside the checkpoint: refused unread"
        )


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
