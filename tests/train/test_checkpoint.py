"""Checkpoints (raymesh.train.checkpoint) over real torch.distributed: 2 gloo ranks on 127.0.0.1.

One spawned 2-rank job (module fixture, no Ray) writes every checkpoint the tests need: DDP with
keep=2, an async save, FSDP2, and collective loads across strategies. The tests then check the
files, and load at world size 1 in this process (no process group), which reshards.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
)

from raymesh.train.checkpoint import Checkpointer, CheckpointError, Manifest, export_state_dict

WORLD = 2
CONFIG = {"seed": 0, "global_batch_size": 8, "checkpoint": {"dir": "x", "keep": 2}}


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    torch.manual_seed(1000 * step + rank)  # different data per rank, as in real training
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state as plain, unsharded CPU data with canonical names (collective
    for FSDP; every rank gets it)."""
    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd}


def _assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert torch.equal(a.detach().cpu(), b.detach().cpu()), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _fsdp(model: torch.nn.Sequential) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)  # the same module, now also an FSDPModule


def _job(rank: int, port: int, root: Path) -> None:
    """Each rank of the 2-rank job. Rank 0 saves reference states as <root>/<name>.pt."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        _scenarios(rank, root)
    finally:
        dist.destroy_process_group()


def _scenarios(rank: int, root: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    def ref(name: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        state = _full_state(model, opt)
        if rank == 0:
            torch.save(state, root / f"{name}.pt")

    def save(ck: Checkpointer, step: int, model: Any, opt: Any, strategy: str) -> None:
        ck.save(
            step,
            model,
            opt,
            world_size=WORLD,
            strategy=strategy,
            config=CONFIG,
            data_position=step * 10,
            rank=rank,
        )

    # DDP, blocking saves at steps 1..3, keep=2.
    model = DDP(_mlp())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ck = Checkpointer(root / "ddp", keep=2)
    for step in (1, 2, 3):
        _train(model, opt, step, rank)
        save(ck, step, model, opt, "ddp")
        ref(f"ddp-{step}", model, opt)

    # Async: the state is captured at save(); training on before wait() must not leak into it.
    ck_async = Checkpointer(root / "async", async_save=True)
    for step in (4, 5):
        _train(model, opt, step, rank)
        save(ck_async, step, model, opt, "ddp")
        ref(f"async-{step}", model, opt)
    _train(model, opt, 6, rank)
    ck_async.wait()

    # FSDP2 (fully_shard) on gloo CPU, 2 steps.
    fsdp = _fsdp(_mlp())
    fsdp_opt = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    for step in (1, 2):
        _train(fsdp, fsdp_opt, step, rank)
    save(Checkpointer(root / "fsdp"), 2, fsdp, fsdp_opt, "fsdp")
    ref("fsdp-2", fsdp, fsdp_opt)

    # Collective loads across strategies at world size 2: DDP -> FSDP2 and FSDP2 -> DDP.
    into_fsdp = _fsdp(_mlp())
    into_fsdp_opt = torch.optim.Adam(into_fsdp.parameters(), lr=1e-2)
    Checkpointer(root / "ddp").load(root / "ddp" / "step-00000003", into_fsdp, into_fsdp_opt)
    ref("ddp-into-fsdp", into_fsdp, into_fsdp_opt)
    into_ddp = DDP(_mlp())
    into_ddp_opt = torch.optim.Adam(into_ddp.parameters(), lr=1e-2)
    Checkpointer(root / "fsdp").load(root / "fsdp" / "step-00000002", into_ddp, into_ddp_opt)
    ref("fsdp-into-ddp", into_ddp, into_ddp_opt)

    # A corrupt checkpoint: every rank refuses it (rank 0 checks, all raise; nobody hangs).
    if rank == 0:
        shutil.copytree(root / "ddp" / "step-00000003", root / "corrupt" / "step-00000003")
        _flip_a_byte(root / "corrupt" / "step-00000003")
    dist.barrier()
    try:
        Checkpointer(root / "corrupt").load(root / "corrupt" / "step-00000003", model, opt)
        outcome = "loaded"
    except CheckpointError as e:
        outcome = f"CheckpointError: {e}"
    (root / f"corrupt-rank{rank}.txt").write_text(outcome)


def _flip_a_byte(folder: Path) -> str:
    """Flip one byte in the middle of the folder's largest DCP data file; return its name."""
    victim = max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    return victim.name


def _run(rank: int, port: int, root: str) -> None:
    # Gloo otherwise binds the interface its hostname resolves to, which may not be loopback.
    if sys.platform == "linux":
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    _job(rank, port, Path(root))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run the 2-rank job once; the folder holds its checkpoints and reference states."""
    root = tmp_path_factory.mktemp("ckpt")
    ctx = mp.spawn(_run, args=(_free_port(), str(root)), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 100
    while not ctx.join(timeout=1):  # raises with the rank's traceback if one failed
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the 2-rank checkpoint job did not finish in 100 s (a hang)")
    return root


def _ref(job: Path, name: str) -> dict[str, Any]:
    return torch.load(job / f"{name}.pt", weights_only=True)


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _mlp()
    torch.manual_seed(123)  # different weights from the saved ones
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def _copy(job: Path, name: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(job / name, tmp_path / name))


def test_save_commits_a_checkpoint_that_latest_finds_with_its_manifest(job: Path) -> None:
    path = Checkpointer(job / "ddp").latest()
    assert path == job / "ddp" / "step-00000003"
    manifest = Manifest.from_json((path / "manifest.json").read_text())
    assert (manifest.step, manifest.world_size, manifest.strategy) == (3, WORLD, "ddp")
    assert (manifest.config, manifest.data_position, manifest.format) == (CONFIG, 30, 1)
    assert ".metadata" in manifest.files and len(manifest.files) >= 2
    assert set(manifest.files) == {
        p.relative_to(path).as_posix() for p in path.rglob("*") if p.name != "manifest.json"
    }
    assert all(len(digest) == 64 for digest in manifest.files.values())
    assert time.time() - 600 < manifest.created <= time.time()


def test_keep_prunes_to_the_newest_checkpoints_and_leaves_no_temporary_folders(job: Path) -> None:
    assert sorted(p.name for p in (job / "ddp").iterdir()) == ["step-00000002", "step-00000003"]


def test_a_corrupted_newest_checkpoint_is_skipped_with_a_warning(
    job: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _copy(job, "ddp", tmp_path)
    victim = _flip_a_byte(folder / "step-00000003")
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        assert Checkpointer(folder).latest() == folder / "step-00000002"
    [record] = [r for r in caplog.records if r.name == "raymesh"]
    assert "step-00000003" in record.getMessage()
    assert victim in record.getMessage() and "checksum" in record.getMessage()


def test_partial_checkpoints_are_ignored(
    job: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = _copy(job, "ddp", tmp_path)
    # A save in progress or interrupted: newer, complete-looking, but not committed.
    shutil.copytree(folder / "step-00000003", folder / ".tmp-step-00000009-abc")
    # A step folder without its manifest, and one whose manifest lists a missing file.
    shutil.copytree(folder / "step-00000003", folder / "step-00000008")
    (folder / "step-00000008" / "manifest.json").unlink()
    shutil.copytree(folder / "step-00000003", folder / "step-00000007")
    manifest = Manifest.from_json((folder / "step-00000003" / "manifest.json").read_text())
    (folder / "step-00000007" / "manifest.json").write_text(
        Manifest(**{**manifest.__dict__, "step": 7}).to_json()
    )
    (folder / "step-00000007" / ".metadata").unlink()
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        assert Checkpointer(folder).latest() == folder / "step-00000003"
    messages = " | ".join(r.getMessage() for r in caplog.records if r.name == "raymesh")
    assert "step-00000008: no manifest.json" in messages
    assert "step-00000007: file '.metadata' is missing" in messages
    assert ".tmp-" not in messages


def test_latest_of_an_empty_or_missing_folder_is_none(tmp_path: Path) -> None:
    assert Checkpointer(tmp_path / "nothing-here").latest() is None
    assert Checkpointer(tmp_path).latest() is None


def test_a_ddp_checkpoint_of_two_ranks_loads_into_a_plain_model_at_one_rank(job: Path) -> None:
    model, opt = _fresh()
    manifest = Checkpointer(job / "ddp").load(job / "ddp" / "step-00000003", model, opt)
    assert manifest.step == 3 and manifest.world_size == WORLD
    _assert_same(_ref(job, "ddp-3"), _full_state(model, opt))
    assert opt.param_groups[0]["lr"] == 1e-2  # hyperparameters are restored too


def test_an_fsdp2_checkpoint_of_two_ranks_loads_into_a_plain_model_at_one_rank(job: Path) -> None:
    model, opt = _fresh()
    manifest = Checkpointer(job / "fsdp").load(job / "fsdp" / "step-00000002", model, opt)
    assert manifest.strategy == "fsdp"
    _assert_same(_ref(job, "fsdp-2"), _full_state(model, opt))


def test_checkpoints_load_across_ddp_and_fsdp2_at_two_ranks(job: Path) -> None:
    _assert_same(_ref(job, "ddp-3"), _ref(job, "ddp-into-fsdp"))
    _assert_same(_ref(job, "fsdp-2"), _ref(job, "fsdp-into-ddp"))


def test_every_rank_refuses_to_load_a_corrupt_checkpoint(job: Path) -> None:
    for rank in range(WORLD):
        outcome = (job / f"corrupt-rank{rank}.txt").read_text()
        assert outcome.startswith("CheckpointError: cannot load"), outcome
        assert "fails its checksum" in outcome


def test_loading_a_corrupt_or_partial_checkpoint_raises_and_leaves_the_model_alone(
    job: Path, tmp_path: Path
) -> None:
    folder = _copy(job, "ddp", tmp_path)
    _flip_a_byte(folder / "step-00000003")
    (folder / "step-00000002" / "manifest.json").unlink()
    model, opt = _fresh()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"step-00000003.*fails its checksum"):
        Checkpointer(folder).load(folder / "step-00000003", model, opt)
    with pytest.raises(CheckpointError, match=r"no manifest.json"):
        Checkpointer(folder).load(folder / "step-00000002", model, opt)
    with pytest.raises(CheckpointError, match=r"fails its checksum"):
        export_state_dict(folder / "step-00000003")
    _assert_same(before, model.state_dict())


@pytest.mark.parametrize("name", ["ddp/step-00000003", "fsdp/step-00000002"])
def test_export_state_dict_gives_the_plain_models_state_dict(job: Path, name: str) -> None:
    exported = export_state_dict(job / name)
    expected = _ref(job, name.replace("/step-0000000", "-"))["model"]
    assert set(exported) == set(_mlp().state_dict())  # "0.weight", ...: no "module."/"model."
    _assert_same(expected, exported)
    plain = _mlp()
    plain.load_state_dict(exported)  # strict: exactly the plain model's keys and shapes


def test_async_save_followed_by_wait_commits_the_state_at_the_save(job: Path) -> None:
    ck = Checkpointer(job / "async")
    assert sorted(p.name for p in (job / "async").iterdir()) == ["step-00000004", "step-00000005"]
    assert ck.latest() == job / "async" / "step-00000005"
    for step in (4, 5):
        model, opt = _fresh()
        ck.load(job / "async" / f"step-0000000{step}", model, opt)
        _assert_same(_ref(job, f"async-{step}"), _full_state(model, opt))


def test_without_a_process_group_saves_round_trip_replace_a_step_and_clear_litter(
    tmp_path: Path,
) -> None:
    model, opt = _fresh()
    _train(model, opt, 1, 0)
    ck = Checkpointer(tmp_path, keep=1)
    kwargs: dict[str, Any] = dict(world_size=1, strategy="none", config={}, data_position=1, rank=0)
    (tmp_path / ".tmp-step-00000000-stale").mkdir()  # litter of an interrupted save
    ck.save(1, model, opt, **kwargs)
    _train(model, opt, 2, 0)
    ck.save(1, model, opt, **kwargs)  # the same step again replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]
    restored, restored_opt = _fresh()
    ck.load(ck.latest() or tmp_path, restored, restored_opt)
    _assert_same(_full_state(model, opt), _full_state(restored, restored_opt))


def test_bad_arguments_raise_value_errors_that_name_the_value(tmp_path: Path) -> None:
    model, opt = _fresh()
    kwargs: dict[str, Any] = dict(world_size=1, strategy="none", data_position=0, rank=0)
    with pytest.raises(ValueError, match=r"keep=0"):
        Checkpointer(tmp_path, keep=0)
    with pytest.raises(ValueError, match=r"step=-1"):
        Checkpointer(tmp_path).save(-1, model, opt, config={}, **kwargs)
    with pytest.raises(ValueError, match=r"config is not JSON data"):
        Checkpointer(tmp_path).save(0, model, opt, config={"x": object()}, **kwargs)
    with pytest.raises(ValueError, match=r"format=2"):
        Manifest.from_json(
            '{"format": 2, "step": 1, "world_size": 1, "strategy": "ddp", '
            '"config": {}, "data_position": 0, "files": {}, "created": 0}'
        )
    with pytest.raises(ValueError, match=r"missing field"):
        Manifest.from_json('{"step": 1}')
    assert list(tmp_path.iterdir()) == []


class Plant:
    """Unpickled, it opens `path` for writing, which creates the file: a stand-in for any code a
    planted pickle could run."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def plant_metadata(step: Path, payload: Any) -> None:
    """Replace the checkpoint's `.metadata` with `payload` pickled, and its checksum in the
    manifest to match: what someone who can write the folder can do."""
    import hashlib
    import pickle

    data = pickle.dumps(payload)
    (step / ".metadata").write_bytes(data)
    manifest = Manifest.from_json((step / "manifest.json").read_text())
    files = {**manifest.files, ".metadata": hashlib.sha256(data).hexdigest()}
    (step / "manifest.json").write_text(Manifest(**{**manifest.__dict__, "files": files}).to_json())


@pytest.mark.parametrize("where", ["alone", "inside DCP's own metadata"])
def test_a_pickle_planted_in_metadata_never_runs_and_the_checkpoint_is_refused(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    from raymesh.train.checkpoint.unpickling import MetadataReader

    model, opt = _fresh()
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, model, opt, world_size=1, strategy="none", config={}, data_position=0, rank=0)
    step = tmp_path / "ck" / "step-00000001"
    marker = tmp_path / "planted-code-ran"
    payload: Any = Plant(marker)
    if where != "alone":  # a real index with the plant deep inside one of its fields
        payload = FileSystemReader(step).read_metadata()
        payload.planner_data = {"model.0.weight": [payload.planner_data, Plant(marker)]}
    plant_metadata(step, payload)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"io\.open, which is not one of DCP's metadata"):
        export_state_dict(step)
    with pytest.raises(CheckpointError, match=r"cannot load .*not one of DCP's metadata types"):
        ck.load(step, model, opt)
    with pytest.raises(CheckpointError, match=r"refused unread"):  # what dcp.load reads with
        MetadataReader(step).read_metadata()
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        assert ck.latest() is None  # skipped, with its reason
    assert "io.open" in caplog.text
    assert not marker.exists()
    _assert_same(before, model.state_dict())


def _saved(tmp_path: Path) -> tuple[Checkpointer, Path, torch.nn.Module, torch.optim.Optimizer]:
    """A one-process checkpoint of `_fresh()`'s model at step 1: (checkpointer, step folder,
    model, optimizer)."""
    model, opt = _fresh()
    ck = Checkpointer(tmp_path / "ck")
    ck.save(1, model, opt, world_size=1, strategy="none", config={}, data_position=0, rank=0)
    return ck, tmp_path / "ck" / "step-00000001", model, opt


@pytest.mark.parametrize("where", ["../", "absolute"])
def test_metadata_that_sends_a_read_outside_the_step_folder_is_refused(
    tmp_path: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A `.metadata` whose storage entry names a file outside the folder (here a real DCP file
    with other weights, which DCP would read as the checkpoint's) is refused before any read."""
    from torch.distributed.checkpoint import FileSystemReader

    from raymesh.train.checkpoint.unpickling import MetadataReader

    ck, step, model, opt = _saved(tmp_path)
    mlp = _mlp()  # other weights
    opt2 = torch.optim.Adam(mlp.parameters())
    Checkpointer(tmp_path / "other").save(
        1, mlp, opt2, world_size=1, strategy="none", config={}, data_position=0, rank=0
    )
    outside = tmp_path / "outside.distcp"
    shutil.copy(next((tmp_path / "other" / "step-00000001").glob("*.distcp")), outside)
    metadata = FileSystemReader(step).read_metadata()
    rel = "../../outside.distcp" if where == "../" else str(outside)
    for info in metadata.storage_data.values():
        info.relative_path = rel
    plant_metadata(step, metadata)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"sends a read to .*outside\.distcp.*not a file"):
        export_state_dict(step)
    with pytest.raises(CheckpointError, match=r"cannot load .*not a file inside the checkpoint"):
        ck.load(step, model, opt)
    with pytest.raises(CheckpointError, match=r"not a file inside the checkpoint"):
        MetadataReader(step).read_metadata()  # what every rank's dcp.load reads with
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        assert ck.latest() is None
    _assert_same(before, model.state_dict())


def _within(seconds: float, fn: Any) -> Any:
    """fn()'s result or exception, failing the test if it takes longer than `seconds` (a read
    of a FIFO or /dev/zero that never ends, left behind on a daemon thread)."""
    import threading

    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"still reading after {seconds} s: a read that never ends")
    if "error" in box:
        raise box["error"]
    return box.get("value")


@pytest.mark.parametrize(
    "planted",
    ["manifest a FIFO", "data file -> /dev/zero", "data file -> outside", "step -> /dev/zero"],
)
def test_a_link_to_a_device_a_fifo_or_outside_is_refused_unread_and_promptly(
    tmp_path: Path, planted: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every file a read opens is a regular file inside its step folder, and a step folder is a
    folder: anything else is refused from its stat, never opened, so latest(), export and load
    return at once (a FIFO or /dev/zero would block or never end)."""
    if "/dev/zero" in planted and not Path("/dev/zero").exists():
        pytest.skip("no /dev/zero")
    ck, step, model, opt = _saved(tmp_path)
    data = next(step.glob("*.distcp"))
    elsewhere = tmp_path / "elsewhere"
    if planted == "manifest a FIFO":
        (step / "manifest.json").rename(tmp_path / "manifest.json")
        os.mkfifo(step / "manifest.json")  # opening it for reading waits for a writer
        why = r"'manifest.json' is not a regular file"
    elif planted == "data file -> /dev/zero":
        data.unlink()
        data.symlink_to("/dev/zero")
        why = rf"{data.name!r} is not a regular file"
    elif planted == "data file -> outside":
        shutil.move(data, elsewhere)
        data.symlink_to(elsewhere)
        why = rf"{data.name!r} links to .*elsewhere.*outside the checkpoint"
    else:  # the step folder itself
        shutil.rmtree(step)
        step.symlink_to("/dev/zero")
        why = r"step-00000001' is not a folder"
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        assert _within(10, ck.latest) is None  # no folder: not a step (nothing logged)
    if planted != "step -> /dev/zero":
        assert re.search(why, caplog.text), caplog.text
    with pytest.raises(CheckpointError, match=why):
        _within(10, lambda: export_state_dict(step))
    with pytest.raises(CheckpointError, match=why):
        _within(10, lambda: ck.load(step, model, opt))


def test_a_reload_refuses_a_manifest_whose_params_name_files_outside_the_root(
    tmp_path: Path,
) -> None:
    """What rebuilding a model reads besides the checkpoint (its params' folders and files,
    a Hugging Face base folder) stays under serve's checkpoint_root, as the checkpoint does."""
    from raymesh.serve.model import check_under_root

    root = tmp_path / "runs"
    (root / "data").mkdir(parents=True)
    (root / "data" / "text.txt").write_text("inside")
    outside = tmp_path / "private-model"
    outside.mkdir()
    model, opt = _fresh()
    for name, params in (
        ("inside", {"text": str(root / "data" / "text.txt"), "targets": ["q_proj"], "r": 4}),
        ("outside", {"text": str(root / "data" / "text.txt"), "nested": {"m": str(outside)}}),
        ("linked", {"model": str(root / "data" / "link")}),
    ):
        config = {**CONFIG, "params": params}
        Checkpointer(root / name).save(
            1, model, opt, world_size=1, strategy="none", config=config, data_position=0, rank=0
        )
    (root / "data" / "link").symlink_to(outside)  # under the root by name, out by its target
    assert check_under_root(root / "inside" / "step-00000001", root, files=True)
    for name, shown in (("outside", str(outside)), ("linked", str(root / "data" / "link"))):
        with pytest.raises(PermissionError) as e:
            check_under_root(root / name / "step-00000001", root, files=True)
        message = str(e.value)
        assert f"its manifest names {shown!r}" in message, message
        assert f"outside checkpoint_root={str(root)!r}" in message, message


def test_a_reload_of_an_unreadable_checkpoint_fails_promptly_and_is_not_left_in_progress(
    tmp_path: Path,
) -> None:
    """A run whose manifest is a FIFO (a read that never returns) fails the reload at once, and
    the next reload is not refused as "already in progress"."""
    import asyncio
    import threading
    from types import SimpleNamespace

    from raymesh.serve.model import ModelSpec
    from raymesh.serve.routing.reloader import Reloader

    ck, step, model, _ = _saved(tmp_path)
    (step / "manifest.json").unlink()
    os.mkfifo(step / "manifest.json")
    spec = ModelSpec(model=model)

    async def reload_twice() -> list[str]:
        loop = asyncio.get_running_loop()

        def blocking(fn: Any) -> asyncio.Future[Any]:
            # On a daemon thread: a read that never returns (the bug) must not hold the exit.
            future = loop.create_future()

            def run() -> None:
                try:
                    value = fn()
                except BaseException as e:
                    loop.call_soon_threadsafe(future.set_exception, e)
                else:
                    loop.call_soon_threadsafe(future.set_result, value)

            threading.Thread(target=run, daemon=True).start()
            return future

        # The pool's part a reload uses before any replica is touched.
        pool = SimpleNamespace(spec=spec, slots=[], blocking=blocking)
        reloader = Reloader(pool, pump=lambda: None)  # type: ignore[arg-type]
        errors = []
        for _ in range(2):
            with pytest.raises(ValueError) as e:
                await asyncio.wait_for(reloader.reload(str(ck.dir), root=tmp_path), 10)
            errors.append(str(e.value))
        return errors

    errors = asyncio.run(reload_twice())
    assert all("no committed checkpoint there" in e for e in errors), errors
