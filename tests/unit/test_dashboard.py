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
from tests.certs import self_signed


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


def _strict(text: str) -> Any:
    """JSON as a browser's JSON.parse reads it: NaN and Infinity are errors."""

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_non_finite_number_in_any_line_cannot_break_a_route(tmp_path, client):
    good = json.dumps(_row(1))
    lines = [
        good,
        # Numbers Python reads as infinite or NaN, wherever they stand (nested too).
        '{"step": 2, "loss": 1e999, "samples_per_s": -1e400, "rank_loss": [NaN, Infinity]}',
        '{"step": 3, "loss": -Infinity, "world_size": 1' + "0" * 400 + ', "end": 2E308}',
        '{"step": 1e999, "loss": 1.0}',  # a step that is no number: skipped, named
        '{"step": NaN, "loss": 1.0}',
        json.dumps(_row(4)),
    ]
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    events = [
        json.dumps(_job(os.getpid())).replace('"steps": 10', '"steps": 1e999'),
        '{"t": Infinity, "event": "failure", "rank": 1}',  # no usable time: skipped, named
        '{"t": 1000000002.0, "event": "failure", "rank": 1, "recovery_s": -1e999}',
        '{"t": 1000000009.0, "event": "end", "state": "Finished", "step": 1e999}',
    ]
    (tmp_path / "a" / "events.jsonl").write_text("\n".join(events) + "\n")
    listing = client.get("/api/runs")
    assert listing.status_code == 200
    [summary] = _strict(listing.text)["runs"]
    assert summary["steps"] is None and summary["step"] == 4 and summary["warnings"] == 3
    response = client.get("/api/run/a")
    assert response.status_code == 200
    run = _strict(response.text)
    assert [r["step"] for r in run["rows"]] == [1, 2, 3, 4]
    assert run["rows"][1]["loss"] is None and run["rows"][1]["samples_per_s"] is None
    assert run["rows"][1]["rank_loss"] == [None, None]
    assert run["rows"][2]["loss"] is None and run["rows"][2]["world_size"] is None
    assert run["rows"][2]["end"] is None
    assert [e["event"] for e in run["events"]] == ["job", "failure", "end"]
    assert run["events"][1]["recovery_s"] is None
    warnings = run["warnings"]
    assert sum("line 4: a row needs a numeric step" in w for w in warnings) == 1
    assert any("events.jsonl line 2: an event needs its name and time" in w for w in warnings)
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and 'raymesh_run_step{run="a"} 4.0' in metrics.text
    stream = client.get("/api/stream/a")  # a finished run: its stream sends `end` and stops
    assert stream.status_code == 200
    for line in stream.text.splitlines():
        if line.startswith("data: "):
            _strict(line[len("data: ") :])


def test_an_unknown_run_id_is_looked_up_by_name_and_never_walks_the_root(
    tmp_path, client, monkeypatch
):
    from raymesh.dashboard import runs as runs_module

    _finished_run(tmp_path / "a")
    walks: list[Path] = []
    walk = runs_module._walk
    monkeypatch.setattr(runs_module, "_walk", lambda root: walks.append(root) or walk(root))
    assert client.get("/api/runs").status_code == 200 and len(walks) == 1
    for i in range(50):
        assert client.get(f"/api/run/nope-{i}").status_code == 404
        assert client.get(f"/api/stream/x/nope-{i}").status_code == 404
    # A run folder that appeared since is found at once, by its name, with its study.
    study = tmp_path / "study"
    (study / "results.csv").parent.mkdir()
    (study / "results.csv").write_text("number,state,value,dir\n")
    _finished_run(study / "trials" / "t1", steps=3)
    run = client.get("/api/run/study/trials/t1").json()
    assert run["summary"]["study"] == "study" and len(run["rows"]) == 3
    assert len(walks) == 1, walks


def test_a_run_id_cannot_reach_outside_the_root(tmp_path):
    from raymesh.dashboard.runs import Runs

    root = tmp_path / "root"
    _finished_run(root / "a")
    _finished_run(root / "a" / "inner")  # inside a run folder: not a run (the walk agrees)
    _finished_run(root / ".hidden")
    _finished_run(root / "x" / "y" / "z" / "w" / "deep")  # deeper than the walk looks
    _finished_run(tmp_path / "outside")
    os.symlink(tmp_path / "outside", root / "link-out")
    os.symlink(root / "a", root / "link-in")  # a link that stays inside is a run like any
    runs = Runs(root)
    refused = [
        "../outside",
        "a/../../outside",
        str(tmp_path / "outside"),
        "/" + str(tmp_path / "outside"),
        "link-out",
        ".hidden",
        "a/inner",
        "x/y/z/w/deep",
        "a/",
        "./a",
        "a\0",
        "",
    ]
    for id in refused:
        assert runs.get(id) is None, id
    assert runs.get("a") is not None and runs.get("link-in") is not None
    with TestClient(make_app(root)) as c:
        ids = {r["id"] for r in c.get("/api/runs").json()["runs"]}
        assert ids == {"a", "link-in"}, ids  # the walk leaves links out of the root out too
        for path in ("/api/run/..%2Foutside", "/api/run/%2E%2E/outside", "/api/run/link-out"):
            assert c.get(path).status_code == 404, path
    # A root that is itself a run folder is the one run, known by its name before any listing.
    assert Runs(root / "a").get("a") is not None and Runs(root / "a").get("inner") is None


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
        assert r.status_code == 404 and "no run folder 'gone'" in r.json()["error"]["message"]
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


def test_a_token_is_required_in_a_header_on_every_api_route_and_never_in_a_url(tmp_path):
    _finished_run(tmp_path / "a")
    with TestClient(make_app(tmp_path, token="s3cret-dashboard-token")) as c:
        for path in ("/api/runs", "/api/run/a", "/api/stream/a", "/metrics"):
            r = c.get(path)
            assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
            assert r.headers["WWW-Authenticate"] == "Bearer", path
            assert c.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
            # A token in the query string would end in histories and logs: not accepted.
            assert c.get(path + "?token=s3cret-dashboard-token").status_code == 401, path
        bearer = {"Authorization": "Bearer s3cret-dashboard-token"}
        assert c.get("/api/runs", headers=bearer).json()["runs"][0]["id"] == "a"
        assert c.get("/api/run/a", headers=bearer).status_code == 200
        assert c.get("/metrics", headers=bearer).status_code == 200
        # The pages hold no run data: they load without the token, and ask for it.
        for path in ("/", "/run/a", "/mesh/a", "/static/dashboard.css"):
            assert c.get(path).status_code == 200, path
    with TestClient(make_app(tmp_path)) as c:  # no token: no header needed
        assert c.get("/api/runs").status_code == 200


def test_a_dashboards_urls_never_hold_its_token_and_a_bad_token_is_refused(tmp_path, caplog):
    from raymesh import dashboard

    with caplog.at_level(logging.WARNING, logger="raymesh"):
        with dashboard.start(tmp_path, port=0, token="s3 cr/t-long-enough") as board:
            for url in (board.url, board.page("/mesh/a"), board.run_url("a")):
                assert "s3" not in url and "token" not in url, url
            assert board.login_url().endswith("/#token=s3%20cr%2Ft-long-enough")  # a browser's
            assert "s3" not in repr(board)
            # With a token, the token decides who is served, by any name (a tunnel's, a proxy's).
            port = board.url.rsplit(":", 1)[1].rstrip("/")
            with socket.create_connection(("127.0.0.1", int(port)), timeout=10) as s:
                s.sendall(
                    b"GET /api/runs HTTP/1.1\r\nHost: board.example\r\nConnection: close\r\n"
                    b"Authorization: Bearer s3 cr/t-long-enough\r\n\r\n"
                )
                answer = b"".join(iter(lambda: s.recv(65536), b""))
            assert answer.startswith(b"HTTP/1.1 200"), answer
        assert "reachable" not in caplog.text  # on loopback: nothing to warn of
        with dashboard.start(tmp_path, host="0.0.0.0", port=0):  # `start()` warns, as the CLI
            pass
    said = [r.getMessage() for r in caplog.records if "reachable" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("raymesh-dashboard: 0.0.0.0 is reachable"), said
    assert "no token is set" in said[0] and "$RAYMESH_DASHBOARD_TOKEN" in said[0], said
    # The one rule of every raymesh server (check_token), naming the field, never the value.
    for bad in ("", " x", "x\n", "tøken", b"bytes-of-a-token-of-20"):
        with pytest.raises(ValueError, match=r"token='<hidden>': give ") as e:
            dashboard.start(tmp_path, port=0, token=bad)
        assert str(bad) not in str(e.value) or not bad  # a secret is never echoed
    with pytest.raises(ValueError, match=r"token='<hidden>': the token has 15 .* at least 16"):
        dashboard.start(tmp_path, port=0, token="fifteen-chars!!")  # a guessable token


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


def _serve_cli(args: list[str], capsys) -> tuple[str, threading.Event, threading.Thread]:
    """`raymesh dashboard ARGS` (its own parser) on a thread, once it printed what it prints
    at the start: (that, the event that stops it, the thread)."""
    import argparse

    from raymesh.cli import dashboard as cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers(dest="command"))
    parsed = parser.parse_args(["dashboard", *args])
    stop = threading.Event()
    server = threading.Thread(
        target=cli.run, args=(parsed, stop), name="dashboard-cli", daemon=True
    )
    server.start()
    out = ""
    deadline = time.monotonic() + 30
    while "Ctrl-C to stop" not in out:
        out += capsys.readouterr().out
        assert time.monotonic() < deadline and server.is_alive(), out
        time.sleep(0.05)
    return out, stop, server


def test_the_dashboard_command_serves_until_stopped_and_never_prints_its_token(
    tmp_path, capsys, monkeypatch
):
    import urllib.error
    import urllib.request

    _finished_run(tmp_path / "a")
    monkeypatch.setenv("RAYMESH_DASHBOARD_TOKEN", "from-env-secret-token")
    out, stop, server = _serve_cli([str(tmp_path), "--port", "0"], capsys)
    try:
        url = out.split()[2]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/"), url
        assert "from-env-secret-token" not in out and "$RAYMESH_DASHBOARD_TOKEN" in out, out
        request = urllib.request.Request(
            f"{url}api/runs", headers={"Authorization": "Bearer from-env-secret-token"}
        )
        with urllib.request.urlopen(request, timeout=10) as r:
            assert json.load(r)["runs"][0]["id"] == "a"
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(f"{url}api/runs", timeout=10)
    finally:
        stop.set()
        server.join(timeout=30)
    assert not server.is_alive()


def test_the_dashboard_serves_https_with_a_certificate_and_names_a_missing_key(tmp_path, capsys):
    import ssl
    import urllib.request

    pytest.importorskip("cryptography")
    runs = tmp_path / "runs"
    _finished_run(runs / "a")
    cert, key = self_signed(tmp_path)
    out, stop, server = _serve_cli(
        [str(runs), "--port", "0", "--tls-cert", str(cert), "--tls-key", str(key)], capsys
    )
    try:
        url = out.split()[2]
        assert url.startswith("https://127.0.0.1:"), url
        trusted = ssl.create_default_context(cafile=str(cert))
        with urllib.request.urlopen(f"{url}api/runs", timeout=10, context=trusted) as r:
            assert json.load(r)["runs"][0]["id"] == "a"
        with pytest.raises(OSError):  # plain HTTP on the HTTPS port: no answer
            urllib.request.urlopen(url.replace("https", "http"), timeout=10)
    finally:
        stop.set()
        server.join(timeout=30)
    from raymesh.cli.main import main

    assert main(["dashboard", str(runs), "--port", "0", "--tls-cert", str(cert)]) == 2
    assert "tls_key is missing" in capsys.readouterr().err


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
