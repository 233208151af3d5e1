"""`Checkpointer` (save, commit, find, load) and `export_state_dict`: a job's checkpoints written
and read with torch.distributed.checkpoint, in the layout of raymesh.train.checkpoint's docstring
(`layout`), its guarantees (atomic, verified, resharded, no code run) and its requirements. The
commit's collectives are here; rank 0's file work (manifest, fsync, rename) is `commit`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from raymesh.train.checkpoint.commit import Commit, commit_files
from raymesh.train.checkpoint.errors import CheckpointError
from raymesh.train.checkpoint.hf_record import hf_record
from raymesh.train.checkpoint.layout import (
    MODEL,
    OPTIM,
    TMP_PREFIX,
    Manifest,
    committed_steps,
    read_manifest,
    verify,
)
from raymesh.train.checkpoint.unpickling import MetadataReader, WeightsOnlyLoadPlanner

__all__ = ["Checkpointer", "export_state_dict"]

log = logging.getLogger("raymesh")


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
        self._pending: tuple[Future[Any], Commit] | None = None

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
        extra: dict[str, Any] | None = None,
    ) -> None:
        """Checkpoint model and optimizer as `dir/step-<step:08d>`, with `extra` (the caller's
        JSON data, in the manifest, read back as `Manifest.extra`). COLLECTIVE: every rank calls
        it with the same arguments (but its own `rank`). A transformers or PEFT model is also
        recorded in the manifest (`Manifest.hf`, see `hf_record`), so that export and serving
        rebuild it from the checkpoint alone.

        Blocking mode: returns after the checkpoint is committed on every rank. Async mode: first
        commits the previous save, then returns once this one is staged (see the class doc).
        `model` may be a plain module, DDP, or sharded by FSDP2 (FSDP, HSDP): `get_state_dict`
        stores canonical names (no "module." prefix). Re-saving an existing step replaces it.

        Raises ValueError for bad arguments (on every rank, before writing anything) and
        CheckpointError, on every rank, if any rank failed to write or rank 0 failed to commit.
        """
        self.wait()
        config, extra = _checked_args(
            step=step, data_position=data_position, config=config, extra=extra
        )
        _check_rank(rank=rank, world_size=world_size)
        tmp = self._open(step)  # COLLECTIVE: rank 0 names the folder every rank writes into
        commit = Commit(
            tmp=tmp,
            step=step,
            world_size=world_size,
            strategy=strategy,
            config=config,
            data_position=data_position,
            rank=rank,
            extra=extra,
            hf=hf_record(model),  # so export and serve rebuild it without its build function
        )
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {MODEL: model_sd, OPTIM: optim_sd}
        if self.async_save:
            self._pending = (self._write_async(state, commit.tmp), commit)
            return
        self._commit(commit, self._write(state, commit.tmp))

    def _open(self, step: int) -> Path:
        """Make the save's `.tmp-*` folder and return it. COLLECTIVE: every rank writes into the
        same folder, and rank 0 names it."""
        name = self._broadcast(f"{TMP_PREFIX}step-{step:08d}-{uuid.uuid4().hex[:12]}")
        tmp = self.dir / name
        tmp.mkdir(parents=True, exist_ok=True)
        return tmp

    def _write(self, state: dict[str, Any], tmp: Path) -> str | None:
        """Write this rank's part of `state` into `tmp` and wait for it; returns the error
        (`Type: message`), None if written. Never raises: `_commit` reports every rank's error
        on every rank, so that no rank is left waiting in a collective."""
        try:
            with _quiet_single_process():
                dcp.save(
                    state, checkpoint_id=tmp, process_group=self._pg(), no_dist=not _distributed()
                )
        except Exception as e:  # reported on every rank by _commit, not swallowed
            return f"{type(e).__name__}: {e}"
        return None

    def _write_async(self, state: dict[str, Any], tmp: Path) -> Future[Any]:
        """Start writing this rank's part of `state` into `tmp` in the background, once it is
        copied to CPU memory; returns the future that `wait` commits on."""
        with _quiet_single_process():
            response = dcp.async_save(
                state, checkpoint_id=tmp, process_group=self._pg(), no_dist=not _distributed()
            )
        return response if isinstance(response, Future) else response.upload_completion

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

    def _commit(self, commit: Commit, local_error: str | None) -> None:
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
                commit_files(commit, self.dir, keep=self.keep)
            except Exception as e:
                error = f"{type(e).__name__}: {e}"
        # The broadcast doubles as the barrier "committed": no rank returns before rank 0 renamed.
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointError(f"checkpoint of step {commit.step} was not committed: {error}")

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
        for _, path in sorted(committed_steps(self.dir), reverse=True):
            try:
                verify(path)
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
                verify(path)
            except CheckpointError as e:
                error = str(e)
        error = self._broadcast(error)
        if error is not None:
            raise CheckpointError(f"cannot load {str(path)!r}: {error}")
        manifest = read_manifest(path)
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state: dict[str, Any] = {MODEL: model_sd, OPTIM: optim_sd}
        with _quiet_single_process():
            dcp.load(
                state,
                checkpoint_id=path,
                storage_reader=MetadataReader(path),
                planner=WeightsOnlyLoadPlanner(),
                process_group=self._pg(),
                no_dist=not _distributed(),
            )
        set_state_dict(
            model, optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM]
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
    verify(path)
    reader = MetadataReader(path)
    prefix = f"{MODEL}."
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
        dcp.load(state, storage_reader=reader, planner=WeightsOnlyLoadPlanner(), no_dist=True)
    return {key[len(prefix) :]: value for key, value in state.items()}


# -- private ------------------------------------------------------------------------------------


def _checked_args(
    *, step: int, data_position: int, config: dict[str, Any], extra: dict[str, Any] | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check `save`'s step and data position, and return JSON copies of its `config` and
    `extra` (a copy: the commit may come steps later). ValueError naming the first bad one."""
    for name, value in (("step", step), ("data_position", data_position)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r}: must be an integer >= 0")
    try:
        config = json.loads(json.dumps(config))
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"config is not JSON data ({e}); pass plain dicts/lists/numbers/strings, "
            "e.g. TrainConfig.to_dict()"
        ) from None
    try:
        extra = json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra is not JSON data ({e}); pass plain dicts/lists") from None
    return config, extra


def _check_rank(*, rank: int, world_size: int) -> None:
    """ValueError unless `rank` and `world_size` are the process group's (if there is one)."""
    if _distributed() and (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
        raise ValueError(
            f"rank={rank}, world_size={world_size} disagree with the process group "
            f"(rank {dist.get_rank()} of {dist.get_world_size()})"
        )


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns on every single-process call that it is assuming one; here that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")
        yield
