"""raymesh.dashboard over run folders written by hand: the API, live streams, bad input, the
token and Prometheus, through Starlette's TestClient (no Ray; the browser test runs a real job:
tests/dashboard/test_browser.py)."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("starlette")
pytest.importorskip("httpx2")

from starlette.testclient import TestClient

from raymesh.dashboard.app import make_app
from raymesh.dashboard.runs import JsonLines


def _row(step: int, loss: float | None = None) -> dict[str, Any]:
    loss = 3.0 - 0.01 * step if loss is None else loss
    return {
        "step": step,
        "loss": loss,
        "samples_per_s": 100.0,
        "end": 1e9 + step,
        "world_size": 2,
        "spares": 1,
        "rank_step_s": [0.01, 0.02],
        "rank_loss": [loss - 0.1, loss + 0.1],
    }


def _write(path: Path, items: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.writelines(json.dumps(i) + "\n" for i in items)


def _job(pid: int, t: float = 1e9, steps: int = 10) -> dict[str, Any]:
    host = socket.gethostname()
    return {"t": t, "event": "job", "name": "demo", "pid": pid, "host": host, "steps": steps}


def _finished_run(folder: Path, steps: int = 10) -> None:
    _write(folder / "metrics.jsonl", [_row(s) for s in range(1, steps + 1)])
    _write(
        folder / "events.jsonl",
        [
            _job(os.getpid(), steps=steps),
            {"t": 1e9 + 1, "event": "state", "state": "Running", "reason": "go", "step": 0},
            {"t": 1e9 + 2, "event": "strategy", "strategy": "ddp", "reason": "fits"},
            {"t": 1e9 + 3, "event": "failure", "rank": 1, "step": 4, "kind": "died", "cause": "x"},
            {"t": 1e9 + 4, "event": "end", "state": "Finished", "reason": "done", "step": steps},
        ],
    )


@pytest.fixture
def client(tmp_path: Path):
    with TestClient(make_app(tmp_path)) as c:
        yield c


def test_the_runs_page_lists_each_run_folder_with_its_figures_and_a_studys_trials(tmp_path, client):
    _finished_run(tmp_path / "a")
    study = tmp_path / "study"
    _finished_run(study / "trials" / "trial-1", steps=5)
    (study / "results.csv").write_text(
        f"number,state,value,lr,dir\n0,COMPLETE,2.95,0.1,{study / 'trials' / 'trial-1'}\n"
    )
    (tmp_path / "a" / "step-00000010").mkdir()  # a checkpoint folder is not a run
    listing = client.get("/api/runs").json()
    by_id = {r["id"]: r for r in listing["runs"]}
    assert set(by_id) == {"a", "study/trials/trial-1"}, by_id
    a = by_id["a"]
    assert (a["status"], a["step"], a["steps"], a["failures"]) == ("finished", 10, 10, 1)
    assert a["loss"] == pytest.approx(2.9) and a["strategy"] == "ddp" and a["world_size"] == 2
    assert by_id["study/trials/trial-1"]["study"] == "study"
    [s] = listing["studies"]
    assert s["id"] == "study" and s["trials"][0]["run"] == "study/trials/trial-1"
    assert s["trials"][0]["lr"] == "0.1"
    assert listing["problems"] == []


def test_a_run_gives_its_rows_and_events_and_the_pages_are_served(tmp_path, client):
    _finished_run(tmp_path / "a")
    run = client.get("/api/run/a").json()
    assert [r["step"] for r in run["rows"]] == list(range(1, 11))
    assert run["rows"][0]["rank_loss"] == pytest.approx([2.89, 3.09])
    assert [e["event"] for e in run["events"]] == ["job", "state", "strategy", "failure", "end"]
    assert run["warnings"] == []
    for path in ("/", "/run/a", "/mesh/a", "/static/dashboard.js", "/static/uPlot.iife.min.js"):
        assert client.get(path).status_code == 200, path
    assert "uPlot" in client.get("/run/a").text


def test_a_corrupt_line_is_named_and_skipped_and_the_rest_is_served(tmp_path, client, caplog):
    _write(tmp_path / "a" / "metrics.jsonl", [_row(1)])
    with (tmp_path / "a" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "loss": \n[1, 2]\n{"loss": 1.0}\n')
    _write(tmp_path / "a" / "metrics.jsonl", [_row(3)])
    run = client.get("/api/run/a").json()
    assert [r["step"] for r in run["rows"]] == [1, 3]
    assert len(run["warnings"]) == 3, run["warnings"]
    assert run["warnings"][0].startswith("metrics.jsonl line 2 is not a JSON object")
    assert "line 3 is not a JSON object (a JSON list" in run["warnings"][1]
    assert "line 4: a row needs a numeric step" in run["warnings"][2]
    assert "metrics.jsonl line 2" in caplog.text  # the terminal is told too
    assert client.get("/api/runs").json()["runs"][0]["warnings"] == 3


def test_a_line_still_being_written_is_read_once_it_is_whole(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(_row(1)) + "\n" + '{"step": 2, "lo')
    lines = JsonLines(path)
    assert [(n, r["step"]) for n, r in lines.read_new()] == [(1, 1)]
    assert lines.read_new() == []
    with path.open("a") as f:
        f.write('ss": 1.5}\n')
    assert lines.read_new() == [(2, {"step": 2, "loss": 1.5})]
    assert lines.warnings == []


def test_a_diverged_loss_is_served_as_null_not_as_invalid_json(tmp_path, client):
    _write(tmp_path / "a" / "metrics.jsonl", [_row(1), _row(2, loss=float("nan"))])
    response = client.get("/api/run/a")
    assert response.status_code == 200
    assert [r["loss"] for r in json.loads(response.text)["rows"]] == [2.99, None]
    assert client.get("/api/runs").json()["runs"][0]["loss"] is None


def test_steps_trained_again_replace_the_rows_from_there_on(tmp_path, client):
    _write(tmp_path / "a" / "metrics.jsonl", [_row(s) for s in range(1, 7)])
    _write(tmp_path / "a" / "metrics.jsonl", [_row(s, loss=1.0) for s in range(5, 9)])
    rows = client.get("/api/run/a").json()["rows"]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows[4:]] == [1.0] * 4


def test_missing_runs_and_a_missing_root_are_clear_messages(tmp_path):
    with TestClient(make_app(tmp_path / "nope")) as c:
        listing = c.get("/api/runs").json()
        assert listing["runs"] == []
        assert "nope: no such folder" in listing["problems"][0]
        r = c.get("/api/run/gone")
        assert r.status_code == 404 and "no run folder 'gone'" in r.json()["error"]
        assert c.get("/api/stream/gone").status_code == 404


def test_a_job_whose_controller_died_is_interrupted_and_a_live_one_running(tmp_path, client):
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    _write(tmp_path / "dead" / "events.jsonl", [_job(int(dead.stdout))])
    _write(tmp_path / "live" / "events.jsonl", [_job(os.getpid())])
    status = {r["id"]: r["status"] for r in client.get("/api/runs").json()["runs"]}
    assert status == {"dead": "interrupted", "live": "running"}


def test_the_stream_sends_what_is_appended_and_ends_with_the_run(tmp_path, client):
    folder = tmp_path / "live"
    _write(folder / "metrics.jsonl", [_row(1), _row(2)])
    _write(folder / "events.jsonl", [_job(os.getpid())])

    def train() -> None:  # the job goes on after the page connected
        time.sleep(0.6)
        _write(folder / "metrics.jsonl", [_row(3), _row(2, loss=9.0), _row(3), _row(4)])
        _write(folder / "events.jsonl", [{"t": 1e9 + 5, "event": "failure", "rank": 0}])
        time.sleep(0.6)
        _write(folder / "events.jsonl", [{"t": 1e9 + 9, "event": "end", "state": "Failed"}])

    writer = threading.Thread(target=train)
    writer.start()
    messages: list[tuple[str, Any]] = []
    with client.stream("GET", "/api/stream/live?rows=1&events=1") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                messages.append((name, json.loads(line[len("data: ") :])))
    writer.join()
    steps = [r["step"] for n, d in messages if n == "rows" for r in d]
    assert steps == [2, 3, 4], messages  # each step once, in order, past the page's first row
    events = [e["event"] for n, d in messages if n == "events" for e in d]
    assert events == ["failure", "end"], messages
    assert messages[-1][0] == "end" and messages[-1][1]["status"] == "failed"


def test_a_token_is_required_on_every_page_and_api_but_static_files(tmp_path):
    _finished_run(tmp_path / "a")
    with TestClient(make_app(tmp_path, token="s3cret")) as c:
        for path in ("/", "/run/a", "/api/runs", "/api/run/a", "/metrics"):
            r = c.get(path)
            assert r.status_code == 401 and "token" in r.json()["error"], path
        assert c.get("/api/runs?token=wrong").status_code == 401
        assert c.get("/api/runs?token=s3cret").status_code == 200
        assert c.get("/api/run/a", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/static/dashboard.css").status_code == 200


def test_prometheus_gets_each_runs_figures(tmp_path, client):
    _finished_run(tmp_path / "a")
    text = client.get("/metrics").text
    assert 'raymesh_run_step{run="a"} 10.0' in text
    assert 'raymesh_run_failures{run="a"} 1.0' in text
    assert 'raymesh_run_running{run="a"} 0.0' in text
    assert 'raymesh_run_loss{run="a"} 2.9' in text


def test_the_dashboard_command_names_a_missing_folder_and_the_fix(tmp_path, capsys):
    from raymesh.cli.main import main

    assert main(["dashboard", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope does not exist" in err and "e.g. runs/" in err
    (tmp_path / "file").write_text("")
    assert main(["dashboard", str(tmp_path / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_the_dashboard_command_serves_until_stopped(tmp_path, capsys):
    import argparse
    import urllib.request

    from raymesh.cli import dashboard as cli

    _finished_run(tmp_path / "a")
    stop = threading.Event()
    args = argparse.Namespace(root=str(tmp_path), host="127.0.0.1", port=0, token="t")
    done: list[int] = []
    server = threading.Thread(target=lambda: done.append(cli.run(args, stop)))
    server.start()
    deadline = time.monotonic() + 30
    while "raymesh dashboard: http" not in (out := capsys.readouterr().out):
        assert time.monotonic() < deadline and server.is_alive(), out
        time.sleep(0.05)
    url = out.split()[2]
    assert url.startswith("http://127.0.0.1:") and url.endswith("/?token=t"), url
    base = url.split("/?")[0]
    with urllib.request.urlopen(f"{base}/api/runs?token=t", timeout=10) as r:
        assert json.load(r)["runs"][0]["id"] == "a"
    stop.set()
    server.join(timeout=30)
    assert done == [0]


def test_stopping_ends_open_live_streams_instead_of_cutting_them_off(tmp_path, caplog):
    import urllib.request

    from raymesh import dashboard

    _write(tmp_path / "live" / "events.jsonl", [_job(os.getpid())])  # running: streams stay
    board = dashboard.start(tmp_path, port=0)
    base = board.page("/").rstrip("/")
    opened = threading.Event()
    ended: list[bytes] = []

    def watch() -> None:
        with urllib.request.urlopen(f"{base}/api/stream/live", timeout=30) as r:
            opened.set()
            ended.append(r.read())  # until the server ends the stream

    page = threading.Thread(target=watch)
    page.start()
    assert opened.wait(timeout=30)
    with caplog.at_level(logging.INFO, logger="uvicorn.error"):
        board.stop()
    page.join(timeout=30)
    assert ended and not page.is_alive()
    assert "graceful shutdown exceeded" not in caplog.text, caplog.text
