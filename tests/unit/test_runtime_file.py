"""Finding the local runtime: what a program does with each kind of runtime file it may find
(none, its own, a stale one, another version's, garbage, in a directory others can write)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import string
import subprocess
import sys
import time

import pytest

from raymesh._src.backend import runtime_file
from raymesh._src.backend.runtime_file import RuntimeDirError, RuntimeRecord


@pytest.fixture
def folder(tmp_path, monkeypatch):
    path = tmp_path / "rt"
    monkeypatch.setenv("RAYMESH_RUNTIME_DIR", str(path))
    monkeypatch.delenv("RAYMESH_RUNTIME", raising=False)
    return path


def _record(pid: int, **kw) -> RuntimeRecord:
    import ray

    import raymesh

    base = dict(
        address="127.0.0.1:1",
        pid=pid,
        started=time.time(),
        raymesh=raymesh.__version__,
        ray=ray.__version__,
        code=runtime_file.code_fingerprint(),
        cpus=8,
        warm=2,
        log="/dev/null",
    )
    base.update(kw)
    return RuntimeRecord(**base)


def test_none_is_found_where_no_runtime_was_started(folder):
    assert runtime_file.read() is None and runtime_file.find() is None


def test_a_record_is_written_whole_and_private_and_read_back(folder):
    record = _record(os.getpid())
    path = runtime_file.write(record)
    assert runtime_file.read() == record
    assert os.stat(folder).st_mode & 0o777 == 0o700 and os.stat(path).st_mode & 0o777 == 0o600
    assert [p.name for p in folder.iterdir()] == ["runtime.json"]  # no temporary file left


def test_a_stale_file_is_removed_saying_so(folder, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    runtime_file.write(_record(dead.pid))
    with caplog.at_level(logging.WARNING, logger="raymesh"):
        assert runtime_file.find() is None
    assert "is gone; its stale file is removed" in caplog.text
    assert not (folder / "runtime.json").exists()


def test_a_pid_that_is_not_the_daemon_is_not_the_runtime(folder):
    # This test's own process is alive, but its command line is not the daemon's.
    assert not runtime_file.alive(_record(os.getpid()))


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("ray", "1.0.0", "it runs Ray 1.0.0"),
        ("raymesh", "0.0.1", "it runs raymesh 0.0.1"),
        ("code", "0" * 16, "raymesh's code changed since it started"),
    ],
)
def test_a_runtime_of_other_code_is_not_attached_to_and_the_fix_is_said(folder, field, value, said):
    record = _record(os.getpid(), **{field: value})
    assert runtime_file.mismatch(record).startswith(said)
    assert runtime_file.mismatch(_record(os.getpid())) is None


@pytest.mark.parametrize(
    "text", ["{", "[1, 2]", json.dumps({"address": "x"}), "x" * 70_000, '{"pid": true}']
)
def test_a_file_that_is_not_a_record_is_refused_by_name(folder, text):
    folder.mkdir(mode=0o700)
    (folder / "runtime.json").write_text(text)
    with pytest.raises(ValueError, match=r"runtime\.json"):
        runtime_file.read()


def test_a_record_field_of_the_wrong_type_is_named(folder):
    data = dataclasses.asdict(_record(1))
    data["pid"] = "1"
    with pytest.raises(ValueError, match="pid='1'"):
        RuntimeRecord.from_json(data)


def test_a_directory_others_can_write_is_refused_with_the_fix(folder):
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(RuntimeDirError, match="RAYMESH_RUNTIME_DIR"):
        runtime_file.runtime_dir()


def test_runtime_0_skips_even_a_live_runtime(folder, monkeypatch):
    monkeypatch.setenv("RAYMESH_RUNTIME", "0")
    runtime_file.write(_record(os.getpid()))
    assert runtime_file.find() is None


@pytest.mark.parametrize(
    "line",
    [
        "WARNING: 12 PYTHON worker processes have been started on node: abc with address: "
        "127.0.0.1. This could be a result of using a large number of actors",
        "A worker died or was killed while executing a task by an unexpected system error.",
    ],
)
def test_the_raylets_noise_goes_to_the_raymesh_ray_logger_and_other_messages_print(
    line, capsys, caplog
):
    from ray._private import worker as ray_worker

    from raymesh._src.backend import ray_output

    ray_output.quiet_raylet_noise()
    # Unique letters: Ray prints a line again only once it differs in more than digits.
    other = "the raylet says " + "".join(random.choice(string.ascii_letters) for _ in range(16))
    with caplog.at_level(logging.DEBUG, logger="raymesh.ray"):
        ray_worker.print_to_stdstream({"lines": [line], "pid": "raylet", "is_err": False}, False)
        ray_worker.print_to_stdstream({"lines": [other], "pid": "raylet", "is_err": False}, False)
    out = capsys.readouterr()
    assert line not in out.out + out.err and other in out.out + out.err
    assert [r.getMessage() for r in caplog.records if r.name == "raymesh.ray"] == [
        f"(raylet) {line}"
    ]
