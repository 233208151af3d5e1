"""raymesh.serve end to end: real HTTP requests to a real uvicorn server, replicas on real procs
of the session's Ray, real SIGKILLs."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from pathlib import Path

import pytest
import torch

from raymesh import serve
from tests.serve.helpers import (
    Client,
    alphabet,
    load,
    mlp_checkpoint,
    mlp_outputs,
    slow_or_failing,
)
from tests.waiting import wait_for

TOKEN, ADMIN = "test-token-0123456", "test-admin-token"
XS = [[0.01 * (i + j) for j in range(32)] for i in range(64)]  # inputs of examples.mlp (32 wide)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """Checkpoints a and b of examples.mlp, in one folder (mlp_app's checkpoint_root)."""
    root = tmp_path_factory.mktemp("serve")
    return mlp_checkpoint(root / "a", seed=1), mlp_checkpoint(root / "b", seed=2)


@pytest.fixture(scope="module")
def mlp_app(ray_cluster, checkpoints):
    """examples.mlp built as training builds it, with checkpoint a, behind a token; reloads
    with the admin token, from the checkpoints' folder only."""
    app = serve.deploy(
        build="raymesh.examples.mlp:build",
        checkpoint=str(checkpoints[0]),
        replicas=2,
        max_batch_size=16,
        batch_wait_ms=20,
        port=0,
        token=TOKEN,
        admin_token=ADMIN,
        checkpoint_root=str(checkpoints[0].parent),
        max_body_bytes=4096,
    )
    yield app
    app.stop()


@pytest.fixture(scope="module")
def slow_app(ray_cluster):
    """A model that sleeps or raises on demand (see helpers.slow_or_failing), two replicas
    and a short queue."""
    app = serve.deploy(
        slow_or_failing,
        input_shape=(2,),
        replicas=2,
        max_batch_size=4,
        batch_wait_ms=1,
        max_queue=8,
        port=0,
    )
    yield app
    app.stop()


def test_predictions_over_http_match_the_checkpoint_and_are_batched(mlp_app, checkpoints):
    replies = load(mlp_app.url, TOKEN, [{"x": x} for x in XS], clients=16)
    assert {status for status, _ in replies} == {200}
    expected = mlp_outputs(checkpoints[0], XS)
    got = torch.tensor([payload["y"] for _, payload in replies])
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    sizes = mlp_app.stats()["batch_sizes"]
    assert max(sizes) > 1, f"16 clients at once were never batched: {sizes}"
    assert max(sizes) <= 16
    # And from Python, through the same queue.
    y = mlp_app.predict.call_one(XS[3]).get(timeout=30)
    torch.testing.assert_close(torch.tensor(y), torch.tensor(expected[3]), atol=1e-5, rtol=1e-5)
    client = Client(mlp_app.url, TOKEN)
    status, _, page = client.request("GET", "/metrics")
    assert status == 200 and 'raymesh_serve_requests_total{code="200",route="predict"}' in page
    assert "raymesh_serve_batch_size_bucket" in page


def test_bad_requests_are_answered_with_the_field_and_the_fix(mlp_app):
    client = Client(mlp_app.url, TOKEN)
    status, _, body = client.post("/v1/predict", raw=b'{"x": [1, 2,')
    assert status == 400 and body["error"]["type"] == "MalformedJSON"
    status, _, body = client.post("/v1/predict", {"x": XS[0][:5]})
    assert status == 422 and body["error"]["field"] == "x"
    assert "expected 32 items" in body["error"]["message"]
    status, _, body = client.post("/v1/predict", {"x": [*XS[0][:31], "a"]})
    assert status == 422 and body["error"]["field"] == "x[31]"
    status, _, body = client.post("/v1/predict", {"inputs": XS[0]})
    assert status == 422 and body["error"]["field"] == "x"
    status, _, body = client.post("/v1/predict", raw=b'{"x": NaN}')
    assert status == 400
    status, _, body = client.post("/v1/predict", {"x": [0.5] * 2000})  # over 4096 bytes
    assert status == 413
    status, _, body = client.post("/v1/generate", {"prompt": "def "})
    assert status == 404 and "/v1/predict only" in body["error"]["message"]
    anonymous = Client(mlp_app.url)
    assert anonymous.post("/v1/predict", {"x": XS[0]})[0] == 401
    assert anonymous.request("GET", "/metrics")[0] == 401
    assert Client(mlp_app.url, "wrong").post("/v1/predict", {"x": XS[0]})[0] == 401
    assert anonymous.request("GET", "/healthz")[0] == 200
    status, _, body = anonymous.request("GET", "/readyz")
    assert status == 200 and body["replicas"] == 2
    assert client.post("/v1/predict", {"x": XS[0]})[0] == 200  # and it serves on


def test_the_server_binds_loopback_by_default():
    config = serve.ServeConfig()
    assert config.host == "127.0.0.1"


def test_a_model_error_is_a_500_naming_it_and_only_the_inputs_it_fails_on_fail(slow_app):
    pids = slow_app.replica_pids()
    bodies = [{"x": [5000.0 if i % 4 == 0 else 1.0, 0.0]} for i in range(16)]
    replies = load(slow_app.url, None, bodies, clients=8)
    for body, (status, payload) in zip(bodies, replies):
        if body["x"][0] > 1000:
            assert status == 500, payload
            assert payload["error"]["type"] == "ValueError"
            assert "too large" in payload["error"]["message"]
        else:
            assert status == 200 and payload["y"] == [2.0, 0.0]
    assert slow_app.replica_pids() == pids  # no replica was lost or restarted


def test_a_replica_sigkilled_under_load_fails_no_request(slow_app):
    pids = slow_app.replica_pids()
    assert len(pids) == 2
    bodies = [{"x": [float(i), 0.1]} for i in range(96)]
    result: list = []
    loader = threading.Thread(target=lambda: result.extend(load(slow_app.url, None, bodies, 8)))
    loader.start()

    def both_busy() -> bool:
        return all(r["busy"] for r in slow_app.stats()["replicas"])

    wait_for(both_busy, 30, what="batches (of 100 ms) in flight on both replicas")
    os.kill(pids[0], signal.SIGKILL)
    loader.join(timeout=120)
    assert [status for status, _ in result] == [200] * len(bodies), result
    assert [payload["y"][0] for _, payload in result] == [2.0 * i for i in range(96)]
    stats = slow_app.stats()
    assert stats["retried"] >= 1 and stats["replaced"] >= 1, stats
    wait_for(lambda: len(slow_app.replica_pids()) == 2, 30, what="a replacement replica")
    assert pids[0] not in slow_app.replica_pids()


def test_reload_under_load_answers_every_request_from_the_old_or_the_new_weights(
    mlp_app, checkpoints
):
    from raymesh.cli.main import main

    a, b = checkpoints
    xs = XS[:8]
    weights = {"a": mlp_outputs(a, xs), "b": mlp_outputs(b, xs)}
    answers: list[tuple[int, int, object]] = []  # (input, status, answer), in arrival order
    stop = threading.Event()

    def ask(k: int) -> None:
        client = Client(mlp_app.url, TOKEN)
        i = k
        while not stop.is_set():
            status, _, body = client.post("/v1/predict", {"x": xs[i % len(xs)]})
            answers.append((i % len(xs), status, body))
            i += 1

    def which(i: int, body: object) -> str:
        y = torch.tensor(body["y"])  # type: ignore[index]
        for name, outputs in weights.items():
            if torch.allclose(y, torch.tensor(outputs[i]), atol=1e-5, rtol=1e-5):
                return name
        return f"garbage: {body}"

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: len(answers) >= 50, 30, what="requests answered before the reload")
        began = len(answers)
        served = mlp_app.reload(str(b))
        ended = len(answers)
        wait_for(lambda: len(answers) >= ended + 50, 30, what="requests after the reload")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    assert Path(served).parent == b
    assert {status for _, status, _ in answers} == {200}, answers
    seen = [which(i, body) for i, _, body in answers]
    assert set(seen) <= {"a", "b"}, [s for s in seen if s not in ("a", "b")][:3]
    assert ended - began > 0  # requests were answered while the replicas swapped
    assert set(seen[:began]) == {"a"}
    assert set(seen[ended + len(threads) :]) == {"b"}  # each thread may hold one from before
    # `raymesh serve reload` rolls it back, through POST /admin/reload with the admin token.
    argv = ["serve", "reload", "--checkpoint", str(a), "--url", mlp_app.url]
    assert main([*argv, "--admin-token", ADMIN]) == 0
    replies = load(mlp_app.url, TOKEN, [{"x": x} for x in xs], clients=2)
    got = torch.tensor([payload["y"] for _, payload in replies])
    torch.testing.assert_close(got, torch.tensor(weights["a"]), atol=1e-5, rtol=1e-5)
    # A folder with no checkpoint changes nothing.
    client = Client(mlp_app.url, ADMIN)
    status, _, body = client.post("/admin/reload", {"checkpoint": str(a.parent / "nothing")})
    assert status == 422 and body["error"]["field"] == "checkpoint"
    assert mlp_app.stats()["checkpoint"].startswith(str(a))


def test_a_pickle_planted_in_a_reloaded_checkpoint_never_runs_and_changes_nothing(
    mlp_app, checkpoints
):
    from tests.train.test_checkpoint import Plant, plant_metadata

    a, _ = checkpoints
    step = next(a.glob("step-*"))
    planted = a.parent / "planted" / step.name  # under checkpoint_root, so it gets to a replica
    shutil.copytree(step, planted)
    marker = a.parent / "planted-code-ran"
    plant_metadata(planted, Plant(marker))
    status, _, body = Client(mlp_app.url, ADMIN).post("/admin/reload", {"checkpoint": str(planted)})
    assert status == 422, body
    assert "io.open, which is not one of DCP's metadata types" in body["error"]["message"]
    assert not marker.exists()
    assert mlp_app.stats()["checkpoint"].startswith(str(a))
    _, _, answer = Client(mlp_app.url, TOKEN).post("/v1/predict", {"x": XS[0]})
    expected = torch.tensor(mlp_outputs(a, XS[:1])[0])
    torch.testing.assert_close(torch.tensor(answer["y"]), expected, atol=1e-5, rtol=1e-5)


def test_replicas_scale_up_under_load_and_down_when_idle(ray_cluster):
    app = serve.deploy(
        slow_or_failing,
        input_shape=(2,),
        replicas=(1, 2),
        max_batch_size=1,
        batch_wait_ms=0,
        queue_up=1,
        cooldown_s=0.5,
        busy_down=0.4,
        port=0,
    )
    try:
        bodies = [{"x": [1.0, 0.05]} for _ in range(120)]
        replies = load(app.url, None, bodies, clients=6)
        assert {status for status, _ in replies} == {200}

        def decisions(end: str) -> list[str]:
            return [d["reason"] for d in app.stats()["decisions"] if d["reason"].endswith(end)]

        # (The replica added under load may still be starting when the load ends: one replica
        # up is not yet the scale-down, the decision to remove one is.)
        wait_for(
            lambda: decisions("remove a replica") and len(app.replica_pids()) == 1,
            30,
            what="scaling down when idle",
        )
        reasons = [d["reason"] for d in app.stats()["decisions"]]
        ups = [r for r in reasons if r.endswith("add a replica")]
        downs = [r for r in reasons if r.endswith("remove a replica")]
        assert ups and downs, reasons
        assert reasons.index(ups[0]) < reasons.index(downs[-1])
    finally:
        app.stop()


def test_generate_streams_the_same_text_as_the_model_over_sse(ray_cluster):
    from raymesh.examples.tinygpt import TinyGPT, generate

    app = serve.deploy(
        build="raymesh.examples.tinygpt:build",
        generate="raymesh.examples.tinygpt:serve_text",
        seed=0,
        port=0,
    )
    try:
        torch.manual_seed(0)  # as the replica builds it: the same untrained weights
        expected = generate(TinyGPT(), b"def ", 12)[4:].decode("utf-8", errors="replace")
        client = Client(app.url)
        status, _, body = client.post("/v1/generate", {"prompt": "def ", "max_tokens": 12})
        assert status == 200 and body == {"text": expected, "tokens": 12}
        status, headers, events = client.post(
            "/v1/generate", {"prompt": "def ", "max_tokens": 12, "stream": True}
        )
        assert status == 200 and headers["content-type"].startswith("text/event-stream")
        lines = [line for line in events.split("\n") if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 13
        import json

        assert "".join(json.loads(line[6:])["text"] for line in lines[:-1]) == expected
        assert app.generate.call_one("def ", 12).get(timeout=30) == expected  # from Python
        status, _, body = client.post("/v1/generate", {"prompt": "def ", "max_tokens": 0})
        assert status == 422 and body["error"]["field"] == "max_tokens"
    finally:
        app.stop()


def test_a_stream_whose_replica_is_sigkilled_goes_on_from_where_it_was(ray_cluster):
    import json

    app = serve.deploy(slow_or_failing, generate=alphabet, input_shape=(2,), replicas=2, port=0)
    try:
        expected = "".join(alphabet(None, "ab", 100, 0.0, 0))
        client = Client(app.url)
        client.conn.request(
            "POST",
            "/v1/generate",
            body=json.dumps({"prompt": "ab", "max_tokens": 100, "stream": True}).encode(),
            headers=client.headers,
        )
        response = client.conn.getresponse()
        assert response.status == 200
        first = response.readline()  # the first token is out: the stream is running
        assert first.startswith(b"data: ")
        busy = [r["pid"] for r in app.stats()["replicas"] if r["busy"]]
        assert len(busy) == 1
        os.kill(busy[0], signal.SIGKILL)
        rest = (first + response.read()).decode()
        lines = [line for line in rest.split("\n") if line.startswith(("data: ", "event: "))]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        text = "".join(json.loads(line[6:])["text"] for line in lines[:-1])
        assert text == expected  # one unbroken stream: nothing repeated, nothing lost
        assert app.stats()["retried"] >= 1
        wait_for(lambda: len(app.replica_pids()) == 2, 30, what="a replacement replica")
    finally:
        app.stop()


@pytest.mark.timeout(240)
def test_the_ray_serve_backend_answers_and_refuses_the_same_requests(mlp_app, checkpoints):
    app = serve.deploy(
        build="raymesh.examples.mlp:build",
        checkpoint=str(checkpoints[0]),
        backend="ray-serve",
        port=0,
        token=TOKEN,
        max_body_bytes=4096,
    )
    try:
        assert isinstance(app, serve.App) and isinstance(mlp_app, serve.App)
        client = Client(app.url, TOKEN)
        status, _, body = client.post("/v1/predict", {"x": XS[5]})
        assert status == 200
        _, _, ours = Client(mlp_app.url, TOKEN).post("/v1/predict", {"x": XS[5]})
        torch.testing.assert_close(torch.tensor(body["y"]), torch.tensor(ours["y"]))
        status, _, body = client.post("/v1/predict", {"x": XS[5][:3]})
        assert status == 422 and body["error"]["field"] == "x"
        # The token, the body limit and finite numbers hold here too (raymesh's Guard).
        assert Client(app.url).post("/v1/predict", {"x": XS[5]})[0] == 401
        assert Client(app.url, "wrong").post("/v1/predict", {"x": XS[5]})[0] == 401
        assert client.post("/v1/predict", {"x": [0.5] * 2000})[0] == 413
        assert client.post("/v1/predict", raw=b'{"x": 1e400}')[0] == 400
        # From Python too; what Serve runs itself is refused, naming the backend that has it.
        torch.testing.assert_close(
            torch.tensor(app.predict.call_one(XS[5]).get(timeout=30)), torch.tensor(ours["y"])
        )
        with pytest.raises(NotImplementedError, match='backend="raymesh"'):
            app.reload(str(checkpoints[0]))
    finally:
        app.stop()
