"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, verified, resharded.

One module past 400 lines on purpose: the writer (save, then commit: manifest last, rename) and
the readers (latest, load, export: verify against the manifest) are two halves of one on-disk
contract, the layout below, and split they would each hold half of it.

Layout of `Checkpointer(dir)`:

    dir/step-00000050/            a committed checkpoint (the folder name gives the step)
        .metadata                 DCP's index of the tensors (written by rank 0)
        __0_0.distcp ...          DCP data, one file per rank
        manifest.json             step, world size, strategy, config, data position, sha256 of
                                  every other file; written last, so its presence marks a commit
    dir/.tmp-step-00000060-<id>/  a save in progress (or left by a crash): never read, removed
                                  by the next commit

Guarantees:
- Atomic: files are written (and fsynced) into a `.tmp-*` folder; rank 0 then writes the
  manifest, fsyncs it, and renames the folder to `step-XXXXXXXX` in one `os.replace`, then fsyncs
  `dir`. A crash at any point leaves either the previous committed checkpoints or the new one,
  never a half-written `step-*` folder.
- Verified: `latest()`, `load()` and `export_state_dict()` recompute every file's sha256 against
  the manifest before DCP reads a byte. `latest()` skips a corrupt or partial checkpoint with a
  warning on the "raymesh" logger and falls back to the previous one; `load()` and
  `export_state_dict()` raise `CheckpointError` instead of loading it.
- Resharded: the checkpoint holds each tensor's global shape (DCP), so a save at one world size
  and strategy (DDP, FSDP or HSDP via FSDP2's `fully_shard`, a plain module) loads at another.
- No code runs from a checkpoint: DCP reads tensors with `torch.load(weights_only=True)`;
  raymesh's load planner also reads DCP's non-tensor entries (optimizer hyperparameters) with
  `weights_only=True`, where DCP's default would unpickle them freely; and DCP's own `.metadata`
  index, a pickle by DCP's design, is read by `_MetadataUnpickler`, which builds DCP's metadata
  types and the torch and pathlib values they hold, and refuses anything else unread
  (CheckpointError naming it). Every read here goes through `_MetadataReader`.
- Checksums are not proof of origin: the manifest's sha256s catch corruption and partial
  writes, not someone who can write the folder (they can rewrite the manifest too). A checkpoint
  from such a source cannot run code when loaded, but its weights are whatever they wrote.

Requirements: `dir` must be one filesystem that every rank sees (rank 0 hashes and renames the
files the other ranks wrote). `save` and `load` are collective over the default process group,
and create a private gloo group on first use (so they also work when the default group is NCCL,
and an async save's background traffic never mixes with training collectives). Without a process
group (one process), they run locally.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["CheckpointError", "Checkpointer", "Manifest", "export_state_dict"]

log = logging.getLogger("raymesh")

MANIFEST = "manifest.json"
FORMAT = 1  # manifest format this module writes and reads
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-"
# The keys of the saved state: {"model": model_state_dict, "optim": optim_state_dict}. DCP
# flattens nested dicts, so model entries are stored as "model.<fqn>" (e.g. "model.0.weight").
_MODEL = "model"
_OPTIM = "optim"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or is corrupt, partial or not a raymesh checkpoint."""


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
        missing = sorted(names - {"format"} - set(data))
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
        }
        for name, kind in checks.items():
            if not isinstance(data[name], kind) or isinstance(data[name], bool):
                raise ValueError(f"{name}={data[name]!r}: wrong type")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data["files"].items()):
            raise ValueError("files: expected {relative path: sha256 hex}")
        return cls(**data)


class Checkpointer:
    """Saves, finds and loads the checkpoints of one job in `dir`.

    keep: how many committed checkpoints to keep (the newest by step); older ones are removed
        after each commit.
    async_save: write with `dcp.async_save`: `save` returns once the state is copied to CPU
        memory and the files are written by a background thread while training goes on. The
        commit (manifest + rename) of that save happens at the start of the next `save`, or in
        `wait()` — which every rank must call before the job ends (and before reading the
        checkpoint), else the last save stays an uncommitted `.tmp-*` folder. At most one save is
        in flight. Falls back to a blocking save where torch lacks `dcp.async_save`.
    """

    def __init__(self, dir: str | Path, *, keep: int = 3, async_save: bool = False) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep={keep!r}: must be an integer >= 1 (checkpoints to keep)")
        self.dir = Path(dir)
        self.keep = keep
        self.async_save = async_save and hasattr(dcp, "async_save")
        self._group: Any = None  # private gloo group, made on the first collective call
        self._pending: tuple[Future[Any], _Commit] | None = None

    # -- saving ------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        world_size: int,
        strategy: str,
        config: dict[str, Any],
        data_position: int,
        rank: int,
    ) -> None:
        """Checkpoint model and optimizer as `dir/step-<step:08d>`. COLLECTIVE: every rank calls
        it with the same arguments (but its own `rank`).

        Blocking mode: returns after the checkpoint is committed on every rank. Async mode: first
        commits the previous save, then returns once this one is staged (see the class doc).
        `model` may be a plain module, DDP, or sharded by FSDP2 (FSDP, HSDP): `get_state_dict`
        stores canonical names (no "module." prefix). Re-saving an existing step replaces it.

        Raises ValueError for bad arguments (on every rank, before writing anything) and
        CheckpointError, on every rank, if any rank failed to write or rank 0 failed to commit.
        """
        self.wait()
        for name, value in (("step", step), ("data_position", data_position)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}={value!r}: must be an integer >= 0")
        try:
            config = json.loads(json.dumps(config))  # a copy: the commit may come steps later
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"config is not JSON data ({e}); pass plain dicts/lists/numbers/strings, "
                "e.g. TrainConfig.to_dict()"
            ) from None
        if _distributed() and (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
            raise ValueError(
                f"rank={rank}, world_size={world_size} disagree with the process group "
                f"(rank {dist.get_rank()} of {dist.get_world_size()})"
            )
        # Every rank writes into the same folder: rank 0 names it.
        name = self._broadcast(f"{_TMP_PREFIX}step-{step:08d}-{uuid.uuid4().hex[:12]}")
        tmp = self.dir / name
        tmp.mkdir(parents=True, exist_ok=True)
        commit = _Commit(
            tmp=tmp,
            step=step,
            world_size=world_size,
            strategy=strategy,
            config=config,
            data_position=data_position,
            rank=rank,
        )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {_MODEL: model_sd, _OPTIM: optim_sd}
        if self.async_save:
            with _quiet_single_process():
                response = dcp.async_save(
                    state, checkpoint_id=tmp, process_group=self._pg(), no_dist=not _distributed()
                )
            future = response if isinstance(response, Future) else response.upload_completion
            self._pending = (future, commit)
            return
        error = None
        try:
            with _quiet_single_process():
                dcp.save(
                    state, checkpoint_id=tmp, process_group=self._pg(), no_dist=not _distributed()
                )
        except Exception as e:  # reported on every rank by _commit, not swallowed
            error = f"{type(e).__name__}: {e}"
        self._commit(commit, error)

    def wait(self) -> None:
        """Finish the async save in flight, if any, and commit it. COLLECTIVE when a save is in
        flight (every rank has one then, since `save` is collective). A no-op otherwise."""
        if self._pending is None:
            return
        future, commit = self._pending
        self._pending = None
        error = None
        try:
            future.result()
        except Exception as e:  # reported on every rank by _commit, not swallowed
            error = f"{type(e).__name__}: {e}"
        self._commit(commit, error)

    def _commit(self, commit: _Commit, local_error: str | None) -> None:
        # The gather doubles as the barrier "every rank's files are written".
        errors = self._all_gather(local_error)
        failed = {r: e for r, e in enumerate(errors) if e is not None}
        if failed:
            if commit.rank == 0:
                shutil.rmtree(commit.tmp, ignore_errors=True)
            raise CheckpointError(f"checkpoint of step {commit.step} was not written: {failed}")
        error = None
        if commit.rank == 0:
            try:
                self._commit_files(commit)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        # The broadcast doubles as the barrier "committed": no rank returns before rank 0 renamed.
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointError(f"checkpoint of step {commit.step} was not committed: {error}")

    def _commit_files(self, commit: _Commit) -> None:
        files = {
            p.relative_to(commit.tmp).as_posix(): _sha256(p)
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
            created=time.time(),
        )
        with open(commit.tmp / MANIFEST, "w") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(commit.tmp)
        target = self.dir / f"step-{commit.step:08d}"
        if target.exists():
            # rename(2) cannot replace a non-empty folder: move the old one aside (to a .tmp-
            # name, so a crash right here leaves only litter that the next commit removes).
            os.replace(target, self.dir / f"{_TMP_PREFIX}replaced-{target.name}-{uuid.uuid4().hex}")
        os.replace(commit.tmp, target)
        _fsync_dir(self.dir)
        log.info("checkpoint: committed %s", target)
        committed = sorted(_committed(self.dir), reverse=True)
        for _, old in committed[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)
        # At most one save is in flight and it is this one, so every other .tmp-* is stale.
        for entry in self.dir.iterdir():
            if entry.name.startswith(_TMP_PREFIX):
                shutil.rmtree(entry, ignore_errors=True)

    # -- finding and loading -----------------------------------------------------------------

    def latest(self) -> Path | None:
        """The newest committed checkpoint that verifies, or None. Pure file I/O (no process
        group); call it on one rank and pass the path to every rank's `load`.

        A `step-*` folder whose manifest is missing or unreadable, or whose files are missing or
        fail their checksum, is skipped with a warning naming it and the reason; `.tmp-*` folders
        (saves in progress or interrupted) are never considered.
        """
        if not self.dir.is_dir():
            return None
        for _, path in sorted(_committed(self.dir), reverse=True):
            try:
                _verify(path)
            except CheckpointError as e:
                log.warning("checkpoint: skipping %s: %s; trying the previous one", path, e)
                continue
            return path
        return None

    def load(
        self, path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> Manifest:
        """Restore model and optimizer from the checkpoint at `path`; return its manifest.
        COLLECTIVE: every rank calls it with the same path.

        Rank 0 verifies the checksums first; if they fail, every rank raises CheckpointError and
        nothing is loaded. The model may be wrapped differently (plain, DDP, FSDP, HSDP) and the
        world size may differ from the saving one: DCP reads each rank's part of every tensor.
        """
        self.wait()
        path = Path(path)
        error = None
        if not _distributed() or dist.get_rank() == 0:
            try:
                _verify(path)
            except CheckpointError as e:
                error = str(e)
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointError(f"cannot load {str(path)!r}: {error}")
        manifest = Manifest.from_json((path / MANIFEST).read_text())
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {_MODEL: model_sd, _OPTIM: optim_sd}
        with _quiet_single_process():
            dcp.load(
                state,
                checkpoint_id=path,
                storage_reader=_MetadataReader(path),
                planner=_WeightsOnlyLoadPlanner(),
                process_group=self._pg(),
                no_dist=not _distributed(),
            )
        set_state_dict(
            model, optimizer, model_state_dict=state[_MODEL], optim_state_dict=state[_OPTIM]
        )
        return manifest

    # -- collectives ---------------------------------------------------------------------------

    def _pg(self) -> Any:
        if not _distributed():
            return None
        if self._group is None:
            # Collective itself; save/load are collective, so every rank gets here together.
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _broadcast(self, value: Any) -> Any:
        if not _distributed():
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self._pg())
        return box[0]

    def _all_gather(self, value: Any) -> list[Any]:
        if not _distributed():
            return [value]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, value, group=self._pg())
        return out


def export_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """The full, unsharded model weights of the checkpoint at `path`, for serving.

    NOT collective and needs no process group. Checksums are verified first (CheckpointError if
    they fail). Keys are the model's canonical names, exactly `model.state_dict()` of the plain
    (unwrapped) module: no "module." (DDP) prefix and no "model." storage prefix (the checkpoint
    stores {"model": ..., "optim": ...}, which DCP flattens to "model.<name>"). Values are CPU
    tensors at their global shapes, whatever the sharding or world size at save time; the key
    order is DCP's, not the module's (`load_state_dict` does not care). Only the model entries are
    read, never the optimizer's.
    """
    path = Path(path)
    _verify(path)
    reader = _MetadataReader(path)
    prefix = f"{_MODEL}."
    state: dict[str, Any] = {}
    for key, meta in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(prefix):
            if isinstance(meta, TensorStorageMetadata):
                state[key] = torch.empty(meta.size, dtype=meta.properties.dtype)
            else:  # a non-tensor entry (a module's get_extra_state): read as saved
                state[key] = None
    if not state:
        raise CheckpointError(f"{str(path)!r} holds no model entries (keys {prefix!r}*)")
    with _quiet_single_process():
        dcp.load(state, storage_reader=reader, planner=_WeightsOnlyLoadPlanner(), no_dist=True)
    return {key[len(prefix) :]: value for key, value in state.items()}


# -- private ------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class _Commit:
    """What rank 0 needs to commit a written save."""

    tmp: Path
    step: int
    world_size: int
    strategy: str
    config: dict[str, Any]
    data_position: int
    rank: int


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but non-tensor entries are read with weights_only=True (the
    default unpickles them with weights_only=False, which can run arbitrary code)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's `.metadata` and nothing else: a global is found only if it is one of
    DCP's metadata types or a value they hold (a torch dtype, `torch.Size`, a layout, a path).
    Anything else (a function to call, a class whose construction has effects) is refused
    before it is looked up, so no `.metadata`, however it was written, can run code; the
    objects it can build only hold data."""

    _ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",  # an Enum: how TensorProperties pickles a memory format
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},  # a layout by name, from torch's own table
        "torch": {"Size"},  # and the dtypes, checked by type below
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
        "collections": {"OrderedDict"},
    }

    def __init__(self, file: Any, where: str) -> None:
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        if name in self._ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"{self.where} refers to {module}.{name}, which is not one of DCP's metadata "
            "types: refused unread (this file was not written by torch.distributed.checkpoint, "
            "or was altered after)"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointError(f"{self.where} holds a persistent reference: not DCP metadata")


def _read_metadata(file: Any, where: str) -> Metadata:
    """DCP's Metadata from an open `.metadata` file, by `_MetadataUnpickler` (CheckpointError
    for anything else in it, and for a file that is not a pickle)."""
    try:
        metadata = _MetadataUnpickler(file, where).load()
    except CheckpointError:
        raise
    except Exception as e:  # truncated or not a pickle: what pickle raises varies
        raise CheckpointError(f"{where} is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{where} holds a {type(metadata).__name__}, not DCP's Metadata")
    return metadata


class _MetadataReader(FileSystemReader):
    """DCP's FileSystemReader, but `.metadata` is read by `_read_metadata` (DCP's own reader
    unpickles it with `pickle.load`, which runs whatever the file says). The rest of what DCP's
    `read_metadata` does is repeated as it is."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        path: Any
        if hasattr(self, "_get_metadata_path"):  # torch >= 2.6 (rank-specific metadata)
            path = self._get_metadata_path(rank)
        else:
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as file:
            metadata = _read_metadata(file, str(path))
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process call that it is assuming one; here that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield


def _committed(dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step-* folder in `dir`, valid or not."""
    out = []
    for entry in dir.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            out.append((int(match.group(1)), entry))
    return out


def _verify(path: Path) -> Manifest:
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
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest.step:
        raise CheckpointError(f"manifest.json says step {manifest.step}, the folder name differs")
    if ".metadata" not in manifest.files:
        raise CheckpointError("manifest.json lists no DCP .metadata file")
    for rel, expected in sorted(manifest.files.items()):
        file = path / rel
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise CheckpointError(f"manifest.json lists a path outside the folder: {rel!r}")
        try:
            actual = _sha256(file)
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
        _read_metadata(stream, ".metadata")
    return manifest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its folder's entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
