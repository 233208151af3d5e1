"""The flush barrier's parts that need no cluster: the hook on Ray's printing (markers taken
out, the lines before one printed first, forged or foreign markers never counting), the
agent's append, and the bound's setting. The barrier end to end, on real procs:
tests/integration/test_monarch_api.py (`test_stop_and_shutdown_context_return_once_...`)."""

from __future__ import annotations

import secrets

import pytest

from raymesh._src.backend.host_agent import _append
from raymesh._src.backend.log_barrier import MARK, Barrier
from raymesh._src.proc_mesh import log_flush_s


def _batch(pid: int, is_err: bool, *lines: str) -> dict:
    return {"pid": str(pid), "is_err": is_err, "lines": list(lines), "ip": "127.0.0.1"}


@pytest.mark.timeout(10)
def test_a_marker_is_never_printed_and_counts_only_for_its_own_file_and_token():
    barrier, printed = Barrier(), []
    handle = barrier.handler(lambda data: printed.append((data["pid"], data["lines"])))
    token, forged = secrets.token_hex(16), secrets.token_hex(16)
    keys = [("7", False), ("7", True), ("8", False)]
    barrier.expect(keys, token)

    handle(_batch(7, False, "a", "b"))  # a batch without markers goes through as it came
    handle(_batch(7, False, "c", MARK + forged, "d"))
    handle(_batch(9, False, MARK + token))  # another proc's file: counts for no other pid
    assert barrier.pending(keys, token) == keys
    handle(_batch(7, False, MARK + token, "e"))
    handle(_batch(7, True, "tail" + MARK + token))  # a last line written without its newline
    assert printed == [
        ("7", ["a", "b"]),
        ("7", ["c"]),  # the forged marker swallowed, not counted
        ("7", ["d"]),
        ("7", ["e"]),
        ("7", ["tail"]),
    ]
    # pid 7's two files are in; pid 8's marker never came: reported after the timeout.
    assert barrier.wait(keys, token, timeout=0.05) == [("8", False)]
    assert barrier.wait(keys, token, timeout=0) == []  # no longer awaited


@pytest.mark.timeout(10)
def test_the_agent_appends_to_a_log_file_but_never_creates_one(tmp_path):
    log = tmp_path / "worker-1.out"
    log.write_text("last line without newline")
    assert _append(str(log), MARK + "0" * 32 + "\n")
    assert log.read_text() == "last line without newline" + MARK + "0" * 32 + "\n"
    assert not _append(str(tmp_path / "moved.out"), "x\n")
    assert not (tmp_path / "moved.out").exists()


@pytest.mark.parametrize("raw", ["soon", "-1", "nan", "inf"])
def test_a_bad_flush_bound_names_the_variable_the_value_and_the_fix(raw, monkeypatch):
    monkeypatch.setenv("RAYMESH_LOG_FLUSH_S", raw)
    with pytest.raises(ValueError, match=rf"RAYMESH_LOG_FLUSH_S='{raw}': .* a number >= 0"):
        log_flush_s()
    monkeypatch.setenv("RAYMESH_LOG_FLUSH_S", "0")
    assert log_flush_s() == 0.0
    monkeypatch.delenv("RAYMESH_LOG_FLUSH_S")
    assert log_flush_s() == 5.0
