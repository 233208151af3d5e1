"""raymesh.serve's front and router over real HTTP (uvicorn on a free port), with fake replicas
(tests/serve/fakes.py): no Ray, no proc. What a request must pass (the tokens, the admin route
and its checkpoint root, the body's size and deadline, finite numbers, TLS) and what the router
does with its replicas (a reload that fails half-way, a hung replica, a full queue, a latency
window that stays bounded)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import select
import socket
import sys
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest

from raymesh import serve
from raymesh.serve.config import ADMIN_TOKEN_ENV
from tests.certs import self_signed
from tests.serve.fakes import HANG, Fakes, fake_app, fake_checkpoint, weight_of
from tests.serve.helpers import Client, mlp_checkpoint
from tests.waiting import wait_for

TOKEN, ADMIN = "user-token-0123456789", "admin-token-0123456789"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A checkpoint_root holding two fake step folders: w2 (weights 2) and w3 (weights 3)."""
    fake_checkpoint(tmp_path / "root" / "w2")
    fake_checkpoint(tmp_path / "root" / "w3")
    return tmp_path / "root"


def _guarded(root: Path, **fields: Any) -> Any:
    return fake_app(
        root / "w2", token=TOKEN, admin_token=ADMIN, checkpoint_root=str(root), **fields
    )


def test_every_guarded_route_is_401_without_its_own_token(root: Path) -> None:
    with _guarded(root) as (app, fakes):
        routes = [
            ("POST", "/v1/predict", {"x": 1.0}, TOKEN),
            ("POST", "/v1/generate", {"prompt": "a"}, TOKEN),
            ("POST", "/v1/generate", {"prompt": "a", "stream": True}, TOKEN),
            ("GET", "/metrics", None, TOKEN),
            ("POST", "/admin/reload", {"checkpoint": str(root / "w3")}, ADMIN),
        ]
        for method, path, body, right in routes:
            other = ADMIN if right == TOKEN else TOKEN  # the other token opens nothing here
            for token in (None, "wrong", other):
                client = Client(app.url, token)
                client.headers["Accept"] = "text/event-stream"
                status, _, answer = client.request(method, path, body)
                assert status == 401, (path, token, status, answer)
                assert answer["error"]["type"] == "Unauthorized", answer
        assert fakes.reloads == [] and app.stats()["checkpoint"] == str(root / "w2")
        user, admin = Client(app.url, TOKEN), Client(app.url, ADMIN)
        assert user.post("/v1/predict", {"x": 1.0})[2] == {"y": 2.0}
        status, _, body = admin.post("/admin/reload", {"checkpoint": str(root / "w3")})
        assert status == 200 and body["checkpoint"] == str((root / "w3").resolve())
        assert user.post("/v1/predict", {"x": 1.0})[2] == {"y": 3.0}


def test_reload_is_off_without_an_admin_token_and_an_admin_token_needs_a_root(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    with fake_app(root / "w2") as (app, fakes):
        status, _, body = Client(app.url, "any").post(
            "/admin/reload", {"checkpoint": str(root / "w3")}
        )
        assert status == 403 and "POST /admin/reload is off" in body["error"]["message"]
        assert "admin_token" in body["error"]["message"] and fakes.reloads == []
    with pytest.raises(ValueError, match=r"checkpoint_root=None: an admin token .* set it"):
        serve.ServeConfig(admin_token=ADMIN)
    with pytest.raises(ValueError, match=r"admin_token='<hidden>': give a token of its own"):
        serve.ServeConfig(admin_token=TOKEN, token=TOKEN, checkpoint_root=str(root))
    with pytest.raises(ValueError, match=r"checkpoint_root='.*nothing': give the folder"):
        serve.ServeConfig(admin_token=ADMIN, checkpoint_root=str(root / "nothing"))
    monkeypatch.setenv(ADMIN_TOKEN_ENV, ADMIN)
    with pytest.raises(ValueError, match=r"checkpoint_root=None: an admin token"):
        serve.deploy(lambda x: x, port=0)  # refused before anything starts
    with fake_app(root / "w2", checkpoint_root=str(root)) as (app, fakes):  # the env's token
        assert Client(app.url).post("/admin/reload", {"checkpoint": str(root / "w3")})[0] == 401
        status, _, _ = Client(app.url, ADMIN).post("/admin/reload", {"checkpoint": str(root)})
        assert status == 422  # under the root, but no checkpoint there: refused as before
        reply = Client(app.url, ADMIN).post("/admin/reload", {"checkpoint": str(root / "w3")})
        assert reply[0] == 200


def test_reload_loads_only_from_under_the_checkpoint_root(tmp_path: Path, root: Path) -> None:
    outside = fake_checkpoint(tmp_path / "outside" / "w9")
    (root / "link").symlink_to(outside)  # a link in the root to a step folder outside it
    real = mlp_checkpoint(tmp_path / "outside-job", seed=1)  # a checkpoint that verifies
    (root / "job").mkdir()
    (root / "job" / "step-00000001").symlink_to(real / "step-00000001")  # its newest step: out
    fake_checkpoint(root / "w4")
    (outside / "secret").write_text("not weights")
    (root / "w4" / "__0_0.distcp").symlink_to(outside / "secret")  # one file in it links out
    with _guarded(root) as (app, fakes):
        admin = Client(app.url, ADMIN)
        for checkpoint in (
            str(outside),
            str(root / ".." / "outside" / "w9"),
            os.path.relpath(outside),
            str(root / "link"),
            str(root / "job"),
            str(root / "w4"),
        ):
            status, _, body = admin.post("/admin/reload", {"checkpoint": checkpoint})
            assert status == 403, (checkpoint, body)
            assert body["error"]["field"] == "checkpoint"
            assert f"outside checkpoint_root={str(root)!r}" in body["error"]["message"], body
        assert fakes.reloads == [] and app.stats()["checkpoint"] == str(root / "w2")
        assert admin.post("/admin/reload", {"checkpoint": str(root / "w3")})[0] == 200


def test_a_reload_of_a_checkpoint_alone_keeps_its_build_and_imports_none_it_names(
    tmp_path: Path, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How a checkpoint alone is rebuilt is decided at deploy: a reload whose manifest names
    another build function, one that imports here, is a 403 naming config.build, and its
    module is never imported; a checkpoint of the same build reloads."""
    (tmp_path / "mods").mkdir()
    marker = tmp_path / "imported"
    (tmp_path / "mods" / "rm_marker_build.py").write_text(
        f"open({str(marker)!r}, 'w').close()\ndef build(ctx):\n    raise RuntimeError('ran')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "mods"))
    mlp = "raymesh.examples.mlp:build"
    spec = serve.ModelSpec(checkpoint=str(fake_checkpoint(root / "w5", mlp))).resolved()
    assert spec.pinned is not None and spec.pinned.build == mlp
    fake_checkpoint(root / "w6", "rm_marker_build:build")
    fake_checkpoint(root / "w7", mlp)
    with _guarded(root, spec=spec) as (app, fakes):
        admin = Client(app.url, ADMIN)
        status, _, body = admin.post("/admin/reload", {"checkpoint": str(root / "w6")})
        assert status == 403 and body["error"]["field"] == "checkpoint", body
        assert "config.build='rm_marker_build:build'" in body["error"]["message"], body
        assert not marker.exists() and "rm_marker_build" not in sys.modules
        assert fakes.reloads == [] and app.stats()["checkpoint"] == str(root / "w5")
        assert admin.post("/admin/reload", {"checkpoint": str(root / "w7")})[0] == 200
        assert [c for _, c in fakes.reloads] == [str((root / "w7").resolve())]


def test_a_reload_that_fails_on_one_replica_rolls_back_and_fails_no_request(root: Path) -> None:
    new, old = str((root / "w3").resolve()), str(root / "w2")

    def second_to_load_new_fails(replica: Any, spec: Any) -> bool:
        return spec.checkpoint == new and [c for _, c in fakes.reloads].count(new) == 2

    fakes = Fakes(reload_s=0.2)
    fakes.fail_reload = second_to_load_new_fails  # type: ignore[method-assign]
    answers: list[tuple[int, Any]] = []
    stop = threading.Event()

    def ask() -> None:
        client = Client(app.url, TOKEN)
        while not stop.is_set():
            status, _, body = client.post("/v1/predict", {"x": 1.0})
            answers.append((status, body))

    with _guarded(root, fakes=fakes, replicas=3) as (app, _):
        threads = [threading.Thread(target=ask) for _ in range(4)]
        for t in threads:
            t.start()
        try:
            wait_for(lambda: len(answers) >= 20, 30, what="requests answered before the reload")
            status, _, body = Client(app.url, ADMIN).post("/admin/reload", {"checkpoint": new})
            after = len(answers)
            wait_for(lambda: len(answers) >= after + 20, 30, what="requests after the reload")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=30)
        assert status == 422 and body["error"]["type"] == "ReloadFailed", body
        assert "did not load" in body["error"]["message"] and old in body["error"]["message"]
        first, second = fakes.reloads[0][0], fakes.reloads[1][0]
        assert fakes.reloads == [(first, new), (second, new), (first, old)]  # moved, then back
        assert [weight_of(r.spec.checkpoint) for r in fakes.live()] == [2.0, 2.0, 2.0]
        assert app.stats()["checkpoint"] == old
    assert fakes.served_during_reload > 0  # requests really overlapped the swaps
    assert {status for status, _ in answers} == {200}
    # While it ran, the replica moved first answered with the new weights; once it failed,
    # the old ones only (each client thread may still hold one answer from before).
    assert {body["y"] for _, body in answers} <= {2.0, 3.0}
    assert {body["y"] for _, body in answers[after + len(threads) :]} == {2.0}


def test_a_reload_waiting_for_a_replica_that_dies_mid_batch_goes_on(root: Path) -> None:
    # Found by bench/chaos.py: a lost replica's slot stayed busy, and the reload waiting for
    # its batch to end waited forever (start_timeout_s x replicas, then TimeoutError).
    with fake_app(root / "w2", replicas=2, max_batch_size=1, batch_wait_ms=1) as (app, fakes):
        fakes.gate.clear()  # every batch is held in flight until the gate opens
        asked = [
            threading.Thread(target=Client(app.url).post, args=("/v1/predict", {"x": 1.0}))
            for _ in range(2)
        ]
        for t in asked:
            t.start()
        wait_for(lambda: all(r.held for r in fakes.replicas), 10, what="both replicas busy")
        done: list[str] = []
        reload = threading.Thread(target=lambda: done.append(app.reload(str(root / "w3"))))
        reload.start()
        first = app.router.slots[0]  # the reload takes it out of rotation, then waits
        wait_for(lambda: first.held, 10, what="the reload waiting for the first replica")
        first.replica.actor.killed = True  # it dies with its batch in flight
        wait_for(lambda: app.stats()["replaced"] == 1, 10, what="the dead replica lost")
        fakes.gate.set()
        reload.join(timeout=20)
        assert done, "the reload never finished"
        for t in asked:
            t.join(timeout=20)
        wait_for(lambda: len(fakes.live()) == 2, 10, what="a replacement")
        assert {weight_of(r.spec.checkpoint) for r in fakes.live()} == {3.0}


def test_a_hung_replica_is_a_504_and_is_replaced() -> None:
    with fake_app(request_timeout_s=0.5) as (app, fakes):
        client = Client(app.url)
        status, _, body = client.post("/v1/predict", {"x": HANG})
        assert status == 504 and body["error"]["type"] == "Timeout", body
        hung = fakes.replicas[0]
        wait_for(lambda: hung.killed and len(fakes.live()) == 1, 10, what="a replacement")
        assert app.stats()["replaced"] == 1
        assert client.post("/v1/predict", {"x": 2.0})[2] == {"y": 2.0}


def test_a_full_queue_is_503_with_retry_after_and_what_it_took_is_answered() -> None:
    with fake_app(replicas=2, max_batch_size=4, max_queue=8, batch_wait_ms=1) as (app, fakes):
        fakes.gate.clear()  # the replicas hold every batch until the test opens the gate
        got: list[tuple[int, dict[str, str], Any]] = []
        lock = threading.Lock()

        def one() -> None:
            reply = Client(app.url).post("/v1/predict", {"x": 1.0})
            with lock:
                got.append(reply)

        threads = [threading.Thread(target=one) for _ in range(40)]
        for t in threads:
            t.start()

        def held() -> int:
            return sum(len(r.held) for r in fakes.replicas)

        refused = wait_for(
            lambda: (n := len(got)) + held() + app.stats()["queue_depth"] == 40 and n,
            30,
            what="every request computed, queued or refused",
        )
        # At most a full queue and a batch per replica were taken; the rest was refused.
        assert app.stats()["queue_depth"] <= 8 and 1 <= held() <= 8
        assert refused >= 40 - (8 + 2 * 4)
        assert all(status == 503 for status, _, _ in got)
        assert all(int(headers["retry-after"]) >= 1 for _, headers, _ in got)
        fakes.gate.set()
        for t in threads:
            t.join(timeout=30)
        assert sorted(status for status, _, _ in got) == [200] * (40 - refused) + [503] * refused


@pytest.mark.parametrize("replicas", [1, (1, 2)], ids=["fixed", "autoscaled"])
def test_the_latency_window_stays_bounded_however_many_requests(
    replicas: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from raymesh.serve.routing import autoscaler

    monkeypatch.setattr(autoscaler, "LATENCY_SAMPLES", 50)
    # cooldown_s: the autoscaled window is never closed by a decision during the test either
    with fake_app(replicas=replicas, cooldown_s=3600) as (app, _):
        replies = [app.predict.call_one(float(i)) for i in range(300)]
        assert [r.get(timeout=30) for r in replies] == [float(i) for i in range(300)]
        assert len(app.router.autoscaler.window.latencies) == 50


@pytest.fixture(scope="module")
def plain() -> Any:
    with fake_app(token=TOKEN) as (app, _):
        yield app


@pytest.mark.parametrize(
    "raw",
    [
        b'{"x": 1e400}',
        b'{"x": -1e400}',
        b'{"x": [1.0, 2E999]}',
        b'{"x": 1' + b"0" * 400 + b".5}",
        b'{"x": NaN}',
        b'{"x": -Infinity}',
    ],
)
def test_numbers_that_are_not_finite_are_malformed_json(plain: Any, raw: bytes) -> None:
    status, _, body = Client(plain.url, TOKEN).post("/v1/predict", raw=raw)
    assert status == 400 and body["error"]["type"] == "MalformedJSON", body


def test_finite_numbers_pass_and_a_non_finite_temperature_is_refused(plain: Any) -> None:
    client = Client(plain.url, TOKEN)
    assert client.post("/v1/predict", raw=b'{"x": 1e38}')[2] == {"y": 1e38}
    status, _, _ = client.post("/v1/generate", raw=b'{"prompt": "a", "temperature": 1e400}')
    assert status == 400


@pytest.mark.parametrize(
    "path, raw, field",
    [
        # 3.5e38 is finite in float64 and inf in the model's float32
        ("/v1/predict", b'{"x": 3.5e38}', "x"),
        ("/v1/predict", b'{"x": [1.0, [2.0, -3.5e38]]}', "x[1][1]"),
        ("/v1/predict", b'{"x": 1' + b"0" * 400 + b"}", "x"),  # an integer past any float
        ("/v1/generate", b'{"prompt": "a", "temperature": 1' + b"0" * 400 + b"}", "temperature"),
        ("/v1/generate", b'{"prompt": "a", "temperature": 3.5e38}', "temperature"),
        ("/v1/generate", b'{"prompt": "a", "seed": 1' + b"0" * 30 + b"}", "seed"),
        ("/v1/predict", b'{"x": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}", "x"),  # too deep
        ("/v1/predict", b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),  # its stack
    ],
    ids=["f32", "nested", "int", "temperature", "temperature-f32", "seed", "deep", "deeper"],
)
def test_numbers_the_model_cannot_hold_and_deep_nesting_are_400s_naming_the_field(
    plain: Any, path: str, raw: bytes, field: str | None
) -> None:
    status, _, body = Client(plain.url, TOKEN).post(path, raw=raw)
    assert status == 400, body  # not a 500 with a traceback in the log
    assert body["error"]["type"] in ("OutOfRange", "MalformedJSON"), body
    assert body["error"].get("field") == field, body
    if body["error"]["type"] == "OutOfRange":
        assert "out of range" in body["error"]["message"] or "64 bits" in body["error"]["message"]
    client = Client(plain.url, TOKEN)
    assert client.post("/v1/predict", raw=b'{"x": 3.4e38}')[2] == {"y": 3.4e38}  # float32's
    deep = b'{"prompt": "a", "max_tokens": 1, "n": ' + b"[" * 63 + b"]" * 63 + b"}"
    assert client.post("/v1/generate", raw=deep)[0] == 200  # 64 levels, the body's included


def _sse(url: str, body: dict[str, Any], token: str | None = None) -> tuple[socket.socket, Any]:
    """A /v1/generate stream on a raw connection: its socket and a file of its lines."""
    data = json.dumps({**body, "stream": True}).encode()
    auth = b"" if token is None else b"Authorization: Bearer " + token.encode() + b"\r\n"
    s = _raw_request(
        url,
        b"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + auth
        + b"Content-Length: %d\r\n\r\n" % len(data)
        + data,
    )
    return s, s.makefile("rb")


def test_a_stream_whose_deadline_passes_or_whose_client_leaves_stops_its_replica() -> None:
    fakes = Fakes()
    fakes.token_s = 0.05  # 1000 tokens: 50 s, far past every deadline here
    with fake_app(fakes=fakes, request_timeout_s=1.0) as (app, _):
        # The deadline: the stream ends with an error event, and the replica stops computing.
        status, _, text = Client(app.url).post(
            "/v1/generate", {"prompt": "a", "max_tokens": 1000, "stream": True}
        )
        assert status == 200 and "event: error" in text and "Timeout" in text, text
        wait_for(lambda: fakes.generating == 0, 10, what="the timed-out stream stopped")
        assert fakes.tokens_made < 1000
        # The client leaves mid-stream: the front's task is cancelled, the replica told.
        s, lines = _sse(app.url, {"prompt": "a", "max_tokens": 1000})
        with s:
            while not lines.readline().startswith(b"data: "):
                pass  # the first token is out: the stream is running
            assert fakes.generating == 1
            made = fakes.tokens_made
        wait_for(lambda: fakes.generating == 0, 10, what="the abandoned stream stopped")
        assert fakes.tokens_made - made < 500
        assert app.router.dispatcher.stopped_streams == 2
        # The replica is free again, and serves the next stream whole.
        reply = Client(app.url).post("/v1/generate", {"prompt": "ab", "max_tokens": 3})
        assert reply[0] == 200 and reply[2] == {"text": "cde", "tokens": 3}, reply
        assert len(fakes.live()) == 1  # stopped, not killed


def test_a_stream_closed_from_outside_frees_its_replica_once_it_has_stopped() -> None:
    """A front cancelled while it waits in send() (its client left) leaves the stream at a
    token, then closes it from outside. Its replica is freed once, after it has stopped: the
    streams that waited for it never share it."""
    fakes = Fakes()
    fakes.token_s = 0.05
    with fake_app(fakes=fakes) as (app, _):
        dispatcher = app.router.dispatcher

        async def leave_while_two_wait() -> list[str]:
            left = dispatcher.stream("a", 1000)
            await left.__anext__()  # the first token is out: the front sends it
            waiting = [asyncio.ensure_future(_text(app.router.stream("ab", 3))) for _ in "12"]
            for _ in range(500):  # both wait for the one replica
                if len(dispatcher._streams) == 2:
                    break
                await asyncio.sleep(0.01)
            await left.aclose()  # the client is gone: closed at its token
            return list(await asyncio.wait_for(asyncio.gather(*waiting), 20))

        assert app._submit(leave_while_two_wait()).result(30) == ["cde", "cde"]
        assert fakes.most_on_one == 1 and dispatcher.stopped_streams == 1
        assert [r["busy"] for r in app.stats()["replicas"]] == [False]


def test_a_replica_holds_up_to_its_max_streams_and_one_leaving_stops_only_itself() -> None:
    """A replica that says it decodes 3 streams at once: of 4 streams, 3 run on it and the 4th
    waits for a place; a stream whose client leaves mid-batch is stopped alone (the others'
    text whole), its place freed once it has stopped (the 4th then joins), and a batch waits
    until the streams have all left."""
    fakes = Fakes()
    fakes.token_s, fakes.max_streams = 0.02, 3
    with fake_app(fakes=fakes) as (app, _):
        dispatcher = app.router.dispatcher

        async def four() -> list[str]:
            streams = [dispatcher.stream(p, 20) for p in ("a", "ab", "abc", "abcd")]
            firsts = [await s.__anext__() for s in streams[:3]]  # three run
            fourth = asyncio.ensure_future(_text(streams[3]))
            while not dispatcher._streams:
                await asyncio.sleep(0.001)  # the 4th waits for a place
            assert [s.streams for s in app.router.pool.slots] == [3]
            await streams[1].aclose()  # its client left, mid-batch
            texts = [f + await _text(s) for f, s in zip(firsts[::2], streams[::2], strict=True)]
            return [*texts, await asyncio.wait_for(fourth, 20)]

        texts = app._submit(four()).result(30)
        alone = ["".join(chr(ord("a") + (n + i) % 26) for i in range(20)) for n in (1, 3, 4)]
        assert texts == alone
        assert fakes.most_on_one == 3 and dispatcher.stopped_streams == 1
        wait_for(lambda: fakes.generating == 0, 10, what="every stream stopped")
        assert [(r["busy"], r["streams"]) for r in app.stats()["replicas"]] == [(False, 0)]
        status, _, body = Client(app.url).post("/v1/predict", {"x": 2.0})
        assert status == 200 and body == {"y": 2.0}, body


async def _text(pieces: AsyncIterator[str]) -> str:
    return "".join([p async for p in pieces])


def test_a_prompt_over_the_models_context_is_a_400_naming_the_prompt() -> None:
    fakes = Fakes()
    fakes.context = 4
    with fake_app(fakes=fakes) as (app, _):
        status, _, body = Client(app.url).post("/v1/generate", {"prompt": "abcdefgh"})
        assert status == 400 and body["error"]["type"] == "PromptTooLong", body
        assert body["error"]["field"] == "prompt"
        assert Client(app.url).post("/v1/generate", {"prompt": "abc", "max_tokens": 1})[0] == 200


def test_serve_off_loopback_without_a_token_warns_and_a_short_token_is_refused(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAYMESH_SERVE_TOKEN", raising=False)
    with caplog.at_level(logging.WARNING, logger="raymesh.serve"):
        with fake_app(host="0.0.0.0"):
            pass
        with fake_app(host="0.0.0.0", token=TOKEN):
            pass
        with fake_app():  # loopback: nothing to say
            pass
    said = [r.getMessage() for r in caplog.records if "other machines" in r.getMessage()]
    assert len(said) == 2, said
    assert "no token is set" in said[0] and "plain HTTP" in said[1], said
    with pytest.raises(ValueError, match=r"token='<hidden>': the token has 5 characters"):
        serve.ServeConfig(token="short")
    monkeypatch.setenv("RAYMESH_SERVE_TOKEN", "short")
    with pytest.raises(ValueError, match=r"\$RAYMESH_SERVE_TOKEN='<hidden>': the token has 5"):
        _ = serve.ServeConfig().front


def test_serve_on_loopback_without_a_token_answers_only_loopback_names_and_logs_refusals(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with fake_app() as (app, _):
        client = Client(app.url)
        client.headers["Host"] = "rebound.example:80"
        status, _, body = client.post("/v1/predict", {"x": 1.0})
        assert status == 421 and body["error"]["field"] == "Host", body
    with fake_app(token=TOKEN) as (app, _), caplog.at_level(logging.WARNING, "raymesh.serve"):
        for _ in range(30):  # a client that keeps trying
            assert Client(app.url).post("/v1/predict%0aFORGED:%20x", {"x": 1.0})[0] == 401
    lines = [r.getMessage() for r in caplog.records if r.name == "raymesh.serve"]
    assert len(lines) == 20 and all("\n" not in line for line in lines), lines
    assert "refused POST /v1/predict%0aFORGED:%20x from 127.0.0.1: 401" in lines[0], lines[0]


def _raw_request(url: str, head: bytes) -> socket.socket:
    parsed = urlparse(url)
    s = socket.create_connection((parsed.hostname, parsed.port), timeout=10)
    s.sendall(head)
    return s


def test_a_body_slower_than_its_deadline_is_a_408_and_the_connection_closes() -> None:
    # keep_alive_s: an idle connection closed by the keep-alive timer is not mistaken for this
    with fake_app(body_timeout_s=0.5, keep_alive_s=60) as (app, _):
        head = (
            b"POST /v1/predict HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 200\r\n\r\n"
        )
        body = b'{"x": ' + b" " * 192 + b"1}"
        with _raw_request(app.url, head) as s:  # a byte every 50 ms: 10 s for the body
            reply, sent = b"", 0
            while not reply and sent < len(body):
                s.sendall(body[sent : sent + 1])
                sent += 1
                if select.select([s], [], [], 0.05)[0]:
                    reply = s.recv(65536)
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert sent < len(body)  # answered while the body was still coming
            assert b"body_timeout_s=0.5" in reply
            s.settimeout(10)
            while chunk := s.recv(65536):  # and the server hangs up, not the client
                reply += chunk
            assert b"connection: close" in reply.lower()
        with _raw_request(app.url, head) as s:  # the headers, then nothing at all
            assert s.recv(65536).startswith(b"HTTP/1.1 408")
        assert Client(app.url).post("/v1/predict", {"x": 1.0})[2] == {"y": 1.0}


def test_https_with_tls_and_raymesh_serve_reload_reaches_it(
    tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from raymesh.cli.main import main
    from raymesh.serve import Tls

    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)

    cert, key = self_signed(tmp_path)
    with _guarded(root, tls=Tls(cert=str(cert), key=str(key))) as (app, _):
        assert app.url.startswith("https://127.0.0.1:")
        assert Client(app.url, TOKEN, cafile=cert).post("/v1/predict", {"x": 1.0})[2] == {"y": 2.0}
        with pytest.raises(OSError):  # plain HTTP to it gets no answer
            Client(app.url.replace("https", "http"), TOKEN).post("/v1/predict", {"x": 1.0})
        base = ["serve", "reload", "--checkpoint", str(root / "w3"), "--url", app.url]
        assert main([*base, "--admin-token", ADMIN]) == 1  # the system's CAs do not trust it
        assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
        assert main([*base, "--admin-token", TOKEN, "--tls-cert", str(cert)]) == 1
        assert "HTTP 401" in capsys.readouterr().err
        assert main([*base, "--tls-cert", str(cert)]) == 2
        assert ADMIN_TOKEN_ENV in capsys.readouterr().err
        assert main([*base, "--admin-token", ADMIN, "--tls-cert", str(cert)]) == 0
        assert "serve " + str((root / "w3").resolve()) in capsys.readouterr().out
        assert Client(app.url, TOKEN, cafile=cert).post("/v1/predict", {"x": 1.0})[2] == {"y": 3.0}


def test_a_hugging_face_prompt_past_the_models_context_is_refused_naming_the_limit(
    tmp_path: Path,
) -> None:
    # The real replica's check (the fakes' stands in for it above), on a tiny Llama whose
    # byte-level tokenizer makes one token per character.
    pytest.importorskip("transformers")
    import torch

    from raymesh.serve.model import LoadedModel, ModelSpec, PromptTooLong
    from raymesh.train import hf

    folder = hf.save_tiny_llama(tmp_path / "tiny", max_position=16)
    model = LoadedModel(ModelSpec(hf=str(folder)), torch.device("cpu"))
    message = r"prompt: 10 tokens and max_tokens=8 make 18, over the model's context of 16 tokens"
    with pytest.raises(PromptTooLong, match=message):
        next(model.generate("x" * 10, 8, 0.0, 0))
    assert 1 <= len(list(model.generate("x" * 8, 8, 0.0, 0))) <= 8  # 16: it fits
