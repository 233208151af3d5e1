"""Checkpoints with torch.distributed.checkpoint (DCP): sharded, atomic, verified, resharded.

The public front of a package: the writer and the readers (`checkpointer`: `Checkpointer`,
`export_state_dict`; `commit`: what makes a written save a checkpoint; `weights`:
`resolve_checkpoint`, `load_weights`, for serving and exporting) over one on-disk contract
(`layout`: the folders, the manifest and the check that a folder holds what its manifest says),
whose DCP files are read without running code (`unpickling`); a Hugging Face model's record in
the manifest (`hf_record`: what rebuilds it without its build function); `CheckpointError`
(`errors`) is what each of them raises.

Layout of `Checkpointer(dir)`:

    dir/step-00000050/            a committed checkpoint (the folder name gives the step)
        .metadata                 DCP's index of the tensors (written by rank 0)
        __0_0.distcp ...          DCP data, one file per rank
        manifest.json             step, world size, strategy, config, data position, sha256 of
                                  every other file, a Hugging Face model's record; written
                                  last, so its presence marks a commit
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
  index, a pickle by DCP's design, is read by `unpickling`'s unpickler, which builds DCP's metadata
  types and the torch and pathlib values they hold, and refuses anything else unread
  (CheckpointError naming it). Every read here goes through
  `unpickling.MetadataReader`.
- Bounded reads: every file read is a regular file inside its step folder (a FIFO, a device
  such as /dev/zero, or a link out is refused from its stat, unread), `.metadata` may send DCP
  only to files the manifest lists (`layout`).
- Checksums are not proof of origin: the manifest's sha256s catch corruption and partial
  writes, not someone who can write the folder (they can rewrite the manifest too). A checkpoint
  from such a source cannot run code when loaded, but its weights are whatever they wrote.

Requirements: `dir` must be one filesystem that every rank sees (rank 0 hashes and renames the
files the other ranks wrote). `save` and `load` are collective over the default process group,
and create a private gloo group on first use (so they also work when the default group is NCCL,
and an async save's background traffic never mixes with training collectives). Without a process
group (one process), they run locally.
"""

from raymesh.train.checkpoint.checkpointer import Checkpointer, export_state_dict
from raymesh.train.checkpoint.errors import CheckpointError
from raymesh.train.checkpoint.hf_record import check_record, hf_record
from raymesh.train.checkpoint.layout import MANIFEST, Manifest, named_paths, read_manifest
from raymesh.train.checkpoint.weights import check_named_paths, load_weights, resolve_checkpoint

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "Checkpointer",
    "Manifest",
    "check_named_paths",
    "check_record",
    "export_state_dict",
    "hf_record",
    "load_weights",
    "named_paths",
    "read_manifest",
    "resolve_checkpoint",
]

# Their public home, as before this module became a package: what reprs, pickles and a remote
# error's type name (ActorError.remote_type) say.
for _public in (
    CheckpointError,
    Checkpointer,
    Manifest,
    check_named_paths,
    export_state_dict,
    load_weights,
    named_paths,
    read_manifest,
    resolve_checkpoint,
):
    _public.__module__ = __name__
del _public
