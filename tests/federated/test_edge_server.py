"""The edge server's own promises, over real HTTP(S) and without Ray: late answers, long polls
woken by their message, enrolment, what its logs leave out, TLS with the edge client, one
answer in flight per client, one encoding per message."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import numpy as np
import pytest

from raymesh import federated as fl
from raymesh.examples import fedmlp
from raymesh.federated import Tls
from raymesh.federated.config import MIN_BODY_RATE
from raymesh.federated.edge.device import EdgeClient, Untrusted
from raymesh.federated.edge.server import EdgeConfig, EdgeServer
from raymesh.federated.protocol.checks import BadUpdate
from raymesh.federated.protocol.client import Layout
from raymesh.federated.protocol.messages import Advertise, Fit, Participant, decode, encode
from tests.certs import self_signed
from tests.federated import helpers
from tests.waiting import wait_for

TOKEN = "edge-server-token"
SIZE = 1000  # the model's float count, for the body limit (the messages here are small)


@pytest.fixture
def server():
    s = EdgeServer(EdgeConfig(token=TOKEN, poll_s=2.0), first_cid=10, size=SIZE)
    yield s
    s.finish("the test is over", grace_s=0)


def _joined(server: EdgeServer, device: str) -> helpers.RawEdge:
    edge = helpers.RawEdge(server.url, TOKEN)
    assert edge.join(device)[0] == 200
    return edge


def test_an_answer_after_the_driver_gave_up_is_refused_409_and_so_is_a_replay(server):
    edge = _joined(server, "late")
    waiting = server.send(edge.cid, Advertise(1, (edge.cid,)), lambda reply: None)
    msg = edge.next()
    with pytest.raises(TimeoutError):
        waiting.get(timeout=0.05)  # the driver gives up on it
    answer = Participant(fedmlp.client_fn).handle(msg)
    status, body = edge.reply(answer)
    assert status == 409 and "no message waits" in body["error"]["message"]
    waiting = server.send(edge.cid, Advertise(2, (edge.cid,)), lambda reply: None)
    answer = Participant(fedmlp.client_fn).handle(edge.next())
    assert edge.reply(answer)[0] == 200 and waiting.get(timeout=5) == answer
    assert edge.reply(answer)[0] == 409  # the same answer again: a replay


def test_a_long_poll_is_woken_by_its_message_and_costs_nothing_while_it_waits(server):
    """Forty devices wait in long polls: the server spends (almost) no CPU on them (a 5 ms
    sleep loop spent about 0.12 s a second here, an event 0.002 s), and a message queued for
    one goes out at once."""
    edges = [_joined(server, f"poller-{i}") for i in range(40)]
    got: dict[int, object] = {}

    def poll(edge: helpers.RawEdge) -> None:
        got[edge.cid] = edge.call("GET", f"/v1/next?client={edge.cid}")

    threads = [threading.Thread(target=poll, args=(e,), daemon=True) for e in edges]
    for t in threads:
        t.start()
    # Settling time, not a condition: a poll that arrives late costs ~1 ms of the budget.
    time.sleep(0.3)
    cpu = time.process_time()
    time.sleep(1.0)
    idle_cpu = time.process_time() - cpu
    queued = time.monotonic()
    server.send(edges[0].cid, Advertise(1, (edges[0].cid,)), lambda reply: None)
    wait_for(lambda: edges[0].cid in got, 5, what="the woken poll's answer")
    assert time.monotonic() - queued < 0.5
    assert got[edges[0].cid][0] == 200 and got[edges[0].cid][1]["$"] == "Advertise"
    assert idle_cpu < 0.03, f"{idle_cpu:.3f} s of CPU for 1 s of idle long polls"
    for t in threads:
        t.join(timeout=5)
    assert all(got[e.cid][0] == 204 for e in edges[1:])


def test_enrolment_is_one_per_device_and_capped():
    server = EdgeServer(EdgeConfig(token=TOKEN, poll_s=0.2, max_clients=4), first_cid=10, size=SIZE)
    try:
        first = _joined(server, "phone-1")
        again = helpers.RawEdge(server.url, TOKEN)
        status, body = again.join("phone-1")
        assert status == 409 and "enrolled already (client 10)" in body["error"]["message"]
        for bad in ("", "a b", "é", "x" * 129):
            assert again.join(bad)[0] == 422
        assert again.call("POST", "/v1/join", raw=b"not json")[0] == 400
        assert again.call("POST", "/v1/join", raw=b'{"device": Infinity}')[0] == 400
        assert again.call("GET", "/v1/next?client=99")[0] == 404  # never enrolled
        for i in range(3):
            _joined(server, f"phone-{i + 2}")
        status, body = again.join("phone-9")
        assert status == 403 and "max_clients=4" in body["error"]["message"]
        # A device silent for three poll periods (0.6 s) may enrol again: same client, new key.
        status, body = wait_for(
            lambda: (got := again.join("phone-1"))[0] == 200 and got, 10, what="a new enrolment"
        )
        assert body["client"] == first.cid and body["key"] != first.key
        assert first.call("GET", f"/v1/next?client={first.cid}")[0] == 403  # the old key
    finally:
        server.finish("over", grace_s=0)


def test_refusals_are_logged_cut_short_and_a_generated_token_never_is(caplog):
    caplog.set_level(logging.DEBUG)
    config = fl.RunConfig(clients=2, rounds=1, edge=EdgeConfig(poll_s=1.0))
    fed = helpers.LocalFederation(fedmlp.client_fn, fl.FedAvg(fraction=1.0), config)
    try:
        assert fed.edge is not None
        token = fed.edge.token
        assert "one was generated" in caplog.text and "Federation.edge.token" in caplog.text
        edge = helpers.RawEdge(fed.edge.url, token)
        assert edge.join("long-winded")[0] == 200
        fed.edge.send(edge.cid, Advertise(1, (edge.cid,)), lambda reply: None)
        edge.next()
        long_field = {"$": "Adverts", "round": 1, "adverts": [], "Z" * 100_000: 1}
        status, body = edge.call("POST", f"/v1/reply?client={edge.cid}", {"reply": long_field})
        assert status == 422 and len(body["error"]["message"]) <= 1000
        # A flood of forged requests whose path would forge a log line: each refused, the
        # log keeps the path as sent (no newline) and at most 20 lines a minute.
        for _ in range(30):
            forged = edge.call("GET", "/v1/next%0aFORGED-LINE?client=1", token="f" * 24)
            assert forged[0] == 401
    finally:
        assert fed.edge is not None
        fed.edge.finish("over", grace_s=0)  # the raw client will not poll for Done
    refusals = [r.getMessage() for r in caplog.records if "refused POST" in r.getMessage()]
    assert refusals and all(len(m) < 400 for m in refusals), refusals
    forged = [r.getMessage() for r in caplog.records if "FORGED-LINE" in r.getMessage()]
    assert len(forged) == 19 and all("\n" not in m and "%0a" in m for m in forged), forged
    assert "FORGED-LINE" not in caplog.text.replace("%0aFORGED-LINE", "")
    assert token not in caplog.text


def test_the_edge_client_joins_over_https_with_the_servers_certificate(tmp_path):
    """A run's edge server on TLS with a self-signed certificate: the edge client trusts it
    with --ca-file and trains its round; without it, it stops at once, saying why."""
    cert, key = self_signed(tmp_path)
    tls = Tls(cert=str(cert), key=str(key))
    config = fl.RunConfig(
        clients=2,
        rounds=1,
        secure_aggregation=True,
        edge=EdgeConfig(token=TOKEN, wait_for=1, join_timeout_s=30, tls=tls),
    )
    fed = helpers.LocalFederation(fedmlp.client_fn, fl.FedAvg(fraction=1.0), config)
    assert fed.edge is not None and fed.edge.url.startswith("https://127.0.0.1:")
    started = time.monotonic()
    with pytest.raises(Untrusted, match="give --ca-file"):
        EdgeClient(fed.edge.url, TOKEN, fedmlp.client_fn).run()
    assert time.monotonic() - started < 10  # not retried until give_up_s
    device = EdgeClient(fed.edge.url, TOKEN, fedmlp.client_fn, ca_file=str(cert))
    thread = threading.Thread(target=device.run, daemon=True)
    thread.start()
    (rec,) = fed.run().history
    thread.join(timeout=30)
    assert device.cid == 2 and rec.responded == 3 and rec.dropped == {}
    np.testing.assert_allclose(
        fed.weights.astype(np.float64), helpers.fedavg_by_hand([[0, 1, 2]]), atol=1e-6
    )
    with pytest.raises(ValueError, match="is not https"):
        EdgeClient("http://127.0.0.1:1", TOKEN, fedmlp.client_fn, ca_file=str(cert))


def test_the_server_refuses_an_answer_that_trips_the_check_whatever_it_raises(server):
    edge = _joined(server, "odd")

    def check(reply: object) -> None:
        raise KeyError("a check that raises something unexpected")

    waiting = server.send(edge.cid, Advertise(1, (edge.cid,)), check)
    answer = Participant(fedmlp.client_fn).handle(edge.next())
    status, body = edge.reply(answer)
    assert status == 422 and "KeyError" in body["error"]["message"]
    with pytest.raises(BadUpdate, match="KeyError"):
        waiting.get(timeout=5)


def test_a_second_answer_in_flight_from_one_client_is_refused_at_once_unread(server):
    """While one answer of a client streams in, another from the same client is refused (429,
    in raymesh's error shape) without its body being read: this one sends none, so a server
    that read it would wait. The first answer still counts. An answer whose client goes away
    mid-body is no answer: the client may send it again."""
    edge = _joined(server, "twice")
    waiting = server.send(edge.cid, Advertise(1, (edge.cid,)), lambda reply: None)
    answer = Participant(fedmlp.client_fn).handle(edge.next())
    gone = edge.upload()
    gone.send(b'{"reply": ')
    wait_for(lambda: server._edges[edge.cid].replying, 10, what="the answer in flight")
    gone.sock.close()
    wait_for(lambda: not server._edges[edge.cid].replying, 10, what="the answer given up")
    first = edge.upload()
    first.send(b'{"reply": ')
    wait_for(lambda: server._edges[edge.cid].replying, 10, what="the first answer in flight")
    status, body = edge.upload().response(finish=False, timeout=10)
    assert status == 429, (status, body)
    assert body["error"]["type"] == "TooManyRequests" and "in flight" in body["error"]["message"]
    assert not waiting.done()  # the refusal dropped nothing
    first.send(json.dumps(encode(answer)).encode() + b"}")
    assert first.response() == (200, {"ok": True})
    assert waiting.get(timeout=5) == answer


def test_the_token_decides_who_is_served_by_any_host_name(server):
    """The edge server always has a token: a device reaching it by a tunnel's or a proxy's name
    is served, or refused for its token (401), never for the name (421)."""
    for auth, status in ((f"Bearer {TOKEN}", b"200"), ("Bearer wrong-token", b"401")):
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(
                f"POST /v1/join HTTP/1.1\r\nHost: edge.example:443\r\nConnection: close\r\n"
                f"Authorization: {auth}\r\nContent-Length: 19\r\n\r\n"
                '{"device": "proxy"}'.encode()
            )
            answer = b"".join(iter(lambda: s.recv(65536), b""))
        assert answer.startswith(b"HTTP/1.1 " + status), answer


def test_an_answers_body_deadline_follows_the_body_limit_and_a_late_body_is_no_answer(server):
    """The largest honest answer gets its body limit's time at 256 KiB/s (at least 60 s); a
    body later than its deadline is answered 408, and the client is free to answer again."""
    assert server.body_timeout_s == 60.0  # a small model: the floor
    big = EdgeServer(EdgeConfig(token=TOKEN), first_cid=0, size=10_000_000)
    try:  # 110 MB of answer: 7 minutes, which the fixed 60 s would cut off on a slow uplink
        assert big.body_timeout_s == big.limits.max_bytes / MIN_BODY_RATE > 400
    finally:
        big.finish("the test is over", grace_s=0)
    quick = EdgeServer(EdgeConfig(token=TOKEN, body_timeout_s=0.5), first_cid=0, size=SIZE)
    try:
        edge = _joined(quick, "slow")
        quick.send(edge.cid, Advertise(1, (edge.cid,)), lambda reply: None)
        edge.next()
        late = edge.upload()
        late.send(b'{"reply": ')
        status, body = late.response(finish=False, timeout=10)
        assert status == 408 and "body_timeout_s=0.5" in body["error"]["message"], body
        wait_for(lambda: not quick._edges[edge.cid].replying, 10, what="the late answer gone")
    finally:
        quick.finish("the test is over", grace_s=0)
    with pytest.raises(ValueError, match=r"edge.body_timeout_s=0: give seconds > 0"):
        EdgeConfig(body_timeout_s=0)


def test_each_message_is_encoded_once_whatever_the_polls(server, monkeypatch):
    """Polls serve the bytes encoded when the message was queued; two edge clients' Fits of a
    round share one encoding of its weights."""
    from raymesh.federated.edge import server as server_module

    encoded: list[str] = []

    def counting(obj):
        encoded.append(type(obj).__name__)
        return encode(obj)

    monkeypatch.setattr(server_module, "encode", counting)
    a, b = _joined(server, "a"), _joined(server, "b")
    layout = Layout.of(fedmlp.build_model().state_dict())
    weights = np.arange(layout.size, dtype=np.float32)
    for e in (a, b):
        fit = Fit(1, (e.cid,), weights, layout, {}, False, None, 5.0)
        server.send(e.cid, fit, lambda reply: None)
    assert encoded == ["ndarray", "Fit", "Fit"]
    polls = [e.call("GET", f"/v1/next?client={e.cid}") for e in (a, b, a, a, b)]
    assert encoded == ["ndarray", "Fit", "Fit"]
    for (status, body), e in zip(polls, (a, b, a, a, b), strict=True):
        fit = decode(body)
        assert status == 200 and fit.clients == (e.cid,)
        np.testing.assert_array_equal(fit.weights, weights)
