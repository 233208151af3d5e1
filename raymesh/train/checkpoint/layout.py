"""The on-disk layout of a checkpoint folder, its manifest, and the check that a folder holds
what its manifest says (the layout itself is drawn in raymesh.train.checkpoint's docstring).

A `step-XXXXXXXX` folder is committed; a `.tmp-*` one is a save in progress (or left by a
crash) and never read. `manifest.json`, written last, lists every other file with its sha256;
`verify` recomputes them, and reads `.metadata` as a load would, before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from raymesh.train.checkpoint.errors import CheckpointError
from raymesh.train.checkpoint.unpickling import read_metadata

__all__ = ["FORMAT", "MANIFEST", "MODEL", "OPTIM", "STEP_DIR", "TMP_PREFIX", "Manifest"]

MANIFEST = "manifest.json"
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
        missing = sorted(names - {"format", "extra"} - set(data))
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
        }
        data.setdefault("extra", {})
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
    checksum and its `.metadata` holds DCP metadata only; CheckpointError naming the first
    problem otherwise."""
    try:
        text = (path / MANIFEST).read_text()
    except FileNotFoundError:
        if not path.is_dir():
            raise CheckpointError(f"{str(path)!r} is not a folder") from None
        raise CheckpointError("no manifest.json (a partial or interrupted save)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read manifest.json: {e}") from None
    try:
        manifest = Manifest.from_json(text)
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
        read_metadata(stream, ".metadata")
    return manifest


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
