"""Unit tests for `raymesh._common`: the helpers the subsystems share (field checks, `Range`,
job-file tables, "module:function", bearer auth and the error shape, `Pending`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import http.client
import json
import logging
import socket
import threading
from dataclasses import dataclass

import pytest

from raymesh._common import (
    TABLES,
    BearerAuth,
    BearerToken,
    HTTPError,
    Pending,
    Range,
    ServerThread,
    bad,
    check_int,
    check_seconds,
    free_port,
    from_table,
    resolve,
    split_job,
)
from raymesh._common.http_error import RefusalLog
from tests.waiting import wait_for


def test_a_field_error_names_the_field_the_value_and_the_fix():
    assert str(bad("port", 70000, "give a TCP port")) == "port=70000: give a TCP port"
    with pytest.raises(ValueError, match=r"steps=0: give an integer >= 1"):
        check_int("steps", 0, 1)
    with pytest.raises(ValueError, match=r"steps=True: give an integer"):
        check_int("steps", True)  # a bool is never a count
    check_int("seed", -3)
    with pytest.raises(ValueError, match=r"timeout_s=0: give a number of seconds > 0"):
        check_seconds("timeout_s", 0)
    check_seconds("wait_s", 0, zero=True)


@pytest.mark.parametrize(
    "value, message",
    [
        ((1, 2, 3), r"workers=\(1, 2, 3\): give a count, or \(min, max\)"),
        ((3, 2), r"workers=\(3, 2\): min must be <= max"),
        ((0, 2), r"workers=\(0, 2\): give \(min, max\) as integers >= 1"),
        (0, r"workers=0: give an integer >= 1, or \(min, max\)"),
        ("4", r"workers='4'"),
    ],
)
def test_a_bad_range_names_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        Range.check("workers", value)


def test_a_range_is_a_count_or_min_max_and_a_toml_array_becomes_a_tuple():
    assert Range.check("workers", [2, 4]) == (2, 4)
    assert Range.check("workers", 3) == 3
    assert Range.check("data.workers", 0, count_minimum=0) == 0  # a count may go lower
    assert Range.of(3) == Range(3, 3) and Range.of((2, 4)) == Range(2, 4)


@dataclass(frozen=True, kw_only=True)
class _Table:
    name: str
    size: int = 1

    def __post_init__(self) -> None:
        check_int("size", self.size, 1)


def test_a_table_becomes_its_dataclass_and_a_bad_one_is_named():
    assert from_table(_Table, {"name": "a", "size": 2}, "t") == _Table(name="a", size=2)
    with pytest.raises(ValueError, match=r"\[t\] has unknown key\(s\) \['sise'\]; the keys"):
        from_table(_Table, {"name": "a", "sise": 2}, "t")
    with pytest.raises(ValueError, match=r"\[t\] is missing key\(s\) \['name'\]"):
        from_table(_Table, {}, "t")
    with pytest.raises(ValueError, match=r"\[t\] size=0: give an integer >= 1"):
        from_table(_Table, {"name": "a", "size": 0}, "t")
    with pytest.raises(ValueError, match=r"_Table has unknown key\(s\)"):
        from_table(_Table, {"name": "a", "x": 1})  # the top level: named by its class
    with pytest.raises(ValueError, match=r"\[t\]: expected a table of keys, got list"):
        from_table(_Table, [1], "t")


def test_each_command_reads_the_job_and_its_own_table_only():
    assert TABLES == {"tune": "raymesh tune", "serve": "raymesh serve"}
    data = {"steps": 2, "checkpoint": {"dir": "x"}, "tune": {"trials": 2}, "serve": {}}
    job, tables = split_job(data)
    assert job == {"steps": 2, "checkpoint": {"dir": "x"}}
    assert tables == {"tune": {"trials": 2}, "serve": {}}


def test_a_function_is_resolved_from_its_name_or_the_name_is_the_error():
    assert resolve("json:dumps") is json.dumps and resolve(len) is len
    with pytest.raises(ValueError, match=r"client_fn='nope': pass a function"):
        resolve("nope", "client_fn")
    with pytest.raises(ValueError, match=r"cannot import module 'no_such_mod'"):
        resolve("no_such_mod:f")
    with pytest.raises(ValueError, match=r"module 'json' has no function 'nothing'"):
        resolve("json:nothing")


def test_a_bearer_token_takes_any_case_of_the_scheme_and_nothing_else():
    token = BearerToken("s3cret-of-16-chars")
    assert token.allows(b"Bearer s3cret-of-16-chars") and token.allows("bearer s3cret-of-16-chars ")
    assert not token.allows(b"Bearer wrong") and not token.allows(b"s3cret-of-16-chars")
    assert not token.allows(b"") and not token.allows("Bearer s3cr\u00e9t")
    assert not token.allows(b"Bearer \xff")
    refusal = token.refusal()
    assert refusal.status == 401 and refusal.headers == {"WWW-Authenticate": "Bearer"}
    assert refusal.payload() == {
        "error": {
            "type": "Unauthorized",
            "message": "give the server's token: Authorization: Bearer <token>",
        }
    }


def test_a_token_shorter_than_16_characters_is_refused_without_echoing_it():
    for short in ("x", "fifteen-chars!!"):
        with pytest.raises(
            ValueError, match=r"admin_token='<hidden>': the token has \d+ char"
        ) as e:
            BearerAuth(None, short, field="admin_token")
        assert short not in str(e.value) and "at least 16" in str(e.value)
    for wrong in ("", " sixteen-chars-and-more", "sixteen-chars-\u00e9-more"):
        with pytest.raises(ValueError, match=r"token='<hidden>': give"):
            BearerToken(wrong)
    assert BearerToken("sixteen-chars-ok").allows("Bearer sixteen-chars-ok")


def _call(app, path: str, authorization: bytes | None = None) -> tuple[int, dict, dict]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    headers = [] if authorization is None else [(b"authorization", authorization)]
    scope = {"type": "http", "method": "GET", "path": path, "headers": headers}
    asyncio.run(app(scope, receive, send))
    start, body = sent
    return start["status"], dict(start["headers"]), json.loads(body["body"] or b"null")


def test_the_middleware_guards_its_paths_only_and_refuses_in_the_error_shape():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b'{"ok": true}'})

    refused: list[str] = []
    guarded = BearerAuth(
        app,
        "s3cret-of-16-chars",
        paths=("/api/",),
        refused=lambda scope, e: refused.append(scope["path"]),
    )
    assert _call(guarded, "/healthz")[0] == 200
    assert _call(guarded, "/api/x", b"Bearer s3cret-of-16-chars")[0] == 200
    status, headers, body = _call(guarded, "/api/x", b"Bearer nope")
    assert status == 401 and headers[b"www-authenticate"] == b"Bearer"
    assert body["error"]["type"] == "Unauthorized" and refused == ["/api/x"]
    assert _call(BearerAuth(app, None), "/api/x")[0] == 200  # no token: no check


def test_an_error_names_its_type_from_its_status_when_not_given():
    error = HTTPError(409, None, "too late", field="reply")
    assert error.payload() == {
        "error": {"type": "Conflict", "message": "too late", "field": "reply"}
    }


def test_pending_times_out_as_a_timeout_error_and_may_cancel_the_work():
    future: concurrent.futures.Future[int] = concurrent.futures.Future()
    with pytest.raises(TimeoutError, match=r"no reply within 0\.01 s"):
        Pending(future).get(timeout=0.01)
    assert not future.cancelled()  # the work goes on
    with pytest.raises(TimeoutError):
        Pending(future, cancel_on_timeout=True).get(timeout=0.01)
    assert future.cancelled()  # a late result is refused
    done: concurrent.futures.Future[int] = concurrent.futures.Future()
    done.set_exception(TimeoutError("the work's own"))
    with pytest.raises(TimeoutError, match="the work's own"):
        Pending(done).get(timeout=1)
    ok: concurrent.futures.Future[int] = concurrent.futures.Future()
    ok.set_result(3)
    assert Pending(ok).done() and Pending(ok).get() == 3


def test_a_free_port_can_be_bound():
    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


async def _echo(scope, receive, send):
    """An app that reads the whole body, then answers 200 with its size."""
    size, more = 0, True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"%d" % size
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body})


def _ask(port: int, head: bytes, timeout: float = 10.0) -> bytes:
    """One raw request on a fresh connection; the answer (all of it, with Connection: close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        answer = s.recv(65536)
        if b"connection: close" in answer.lower():
            answer += b"".join(iter(lambda: s.recv(65536), b""))
        return answer


def test_clients_that_trickle_or_never_finish_their_request_cannot_hold_the_slots():
    posted = threading.Event()  # the slow body's request has reached the app: it holds a slot

    async def app(scope, receive, send):
        if scope["method"] == "POST":
            posted.set()
        await _echo(scope, receive, send)

    server = ServerThread(
        app,
        host="127.0.0.1",
        port=0,
        name="test-slots",
        max_connections=4,
        keep_alive_s=60,  # an idle kept-alive connection is not what closes these
        head_timeout_s=0.5,
        body_timeout_s=0.5,
    )
    get = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    slow = {
        "silent": b"",
        "head": b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ",
        "body": b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n",
    }
    answers: dict[str, bytes] = {}
    stop = threading.Event()

    def trickle(name: str, s: socket.socket) -> None:
        # A byte every 50 ms for as long as the server takes it: never a whole head or body.
        try:
            while not stop.is_set() and not select_readable(s, 0.05):
                if name != "silent":
                    s.sendall(b"a")
            answers[name] = s.recv(65536)
        except OSError as e:
            answers[name] = repr(e).encode()

    sockets = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in slow]
    for name, s in zip(slow, sockets):  # before any asker connects: the cap is not yet full
        s.sendall(slow[name])
    threads = [threading.Thread(target=trickle, args=a) for a in zip(slow, sockets)]
    try:
        for t in threads:
            t.start()
        # Only once its head is in does the slow body hold a slot: an asker connecting before
        # that fills the cap first, and uvicorn would turn the slow body's request away (503).
        assert posted.wait(10), "the slow body's head never reached the app"
        # The three hold every slot but the asker's own: uvicorn turns requests away...
        wait_for(lambda: _ask(server.port, get).startswith(b"HTTP/1.1 503"), 10, what="a full cap")
        # ...until their deadlines pass: each is answered 408 and closed, and the slots free.
        wait_for(lambda: len(answers) == 3, 10, what="every slow client cut off")
        assert all(a.startswith(b"HTTP/1.1 408") for a in answers.values()), answers
        assert b"head_timeout_s=0.5" in answers["head"] + answers["silent"]
        assert b"body_timeout_s=0.5" in answers["body"]
        assert _ask(server.port, get).startswith(b"HTTP/1.1 200")
        huge = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n"
        assert _ask(server.port, huge).startswith(b"HTTP/1.1 431")  # a head too large
        post = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 300000\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(post + b"Connection: close\r\n\r\n" + b"a" * 300_000)
            answer = b"".join(iter(lambda: s.recv(65536), b""))
        assert answer.startswith(b"HTTP/1.1 200") and b"300000" in answer  # a body in time
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        for s in sockets:
            s.close()
        server.stop()


async def _slow_or_echo(scope, receive, send):
    """`_echo`, but /slow streams its answer in three parts, 0.3 s apart."""
    if scope["path"] != "/slow":
        return await _echo(scope, receive, send)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for part in (b"one", b"two", b"three"):
        await asyncio.sleep(0.3)
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


def test_a_pipelined_request_meets_its_deadline_in_its_turn_and_never_inside_an_answer():
    server = ServerThread(
        _slow_or_echo,
        host="127.0.0.1",
        port=0,
        name="test-pipelined",
        keep_alive_s=60,  # an idle kept-alive connection is not what closes these
        head_timeout_s=0.5,
        body_timeout_s=0.5,
    )
    post = b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
    try:
        for path in (b"/", b"/slow"):  # answered at once; answered longer than the deadline
            get = b"GET " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
                s.sendall(get + post)  # in one write, and then not one byte of the body
                answer = b"".join(iter(lambda: s.recv(65536), b""))  # socket.timeout: held
            first, _, second = answer.partition(b"HTTP/1.1 408")
            # The first answer whole (its last chunk: no 408 in its middle), then the 408.
            assert first.startswith(b"HTTP/1.1 200") and first.endswith(b"\r\n0\r\n\r\n"), answer
            assert path == b"/" or b"three" in first, answer
            assert b"body_timeout_s=0.5" in second, answer
    finally:
        server.stop()


async def _capped(scope, receive, send):
    """An app that reads at most 64 KiB of a body, then refuses it (413, the body unread), as
    raymesh's servers do at a body limit."""
    size, more = 0, True
    while more and size <= 64 << 10:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    error = HTTPError(413, None, "over 64 KiB", headers={"Connection": "close"})
    await error.send(send)


def test_a_client_still_sending_a_body_too_large_reads_its_413_and_a_flood_is_cut_off():
    """The server answers 413 while the body is still arriving: it keeps reading (and dropping)
    the rest, so the client is never reset before it reads the answer; but not forever."""
    from raymesh._common.connection import LINGER_BYTES

    server = ServerThread(_capped, host="127.0.0.1", port=0, name="test-linger")
    try:
        for attempt in range(8):
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            try:
                if attempt % 2:  # chunked, as a streaming client sends
                    chunks = (b"a" * (64 << 10) for _ in range(32))
                    conn.request("POST", "/", chunks, encode_chunked=True)
                else:  # 2 MiB with a Content-Length, in one write
                    conn.request("POST", "/", b"a" * (2 << 20))
                response = conn.getresponse()
                assert response.status == 413 and b"over 64 KiB" in response.read()
            finally:
                conn.close()
        # A client that keeps sending is cut off once it has sent LINGER_BYTES more.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 999999999\r\n\r\n")
            sent, cut = 0, False
            try:
                while sent < 4 * LINGER_BYTES:
                    sent += s.send(b"a" * (1 << 20))
            except OSError:
                cut = True
            assert cut, f"{sent} bytes sent, the connection still open"
    finally:
        server.stop()


def select_readable(s: socket.socket, timeout: float) -> bool:
    import select

    return bool(select.select([s], [], [], timeout)[0])


def test_a_loopback_server_without_a_token_answers_only_loopback_host_names():
    def host(name: bytes) -> bytes:
        return b"GET / HTTP/1.1\r\nConnection: close\r\nHost: " + name + b"\r\n\r\n"

    server = ServerThread(_echo, host="127.0.0.1", port=0, name="test-hosts")
    try:
        port = b"%d" % server.port
        for name in (b"127.0.0.1:" + port, b"localhost:" + port, b"[::1]:" + port, b"LOCALHOST"):
            assert _ask(server.port, host(name)).startswith(b"HTTP/1.1 200"), name
        for name in (b"evil.example:" + port, b"evil.example", b"127.0.0.1.evil.example", b"[::2]"):
            answer = _ask(server.port, host(name))
            assert answer.startswith(b"HTTP/1.1 421"), (name, answer)
            assert b'"field":"Host"' in answer and b"rebinding" in answer
    finally:
        server.stop()
    # With a token the app checks who asks; off loopback the bind is the user's choice.
    server = ServerThread(_echo, host="127.0.0.1", port=0, name="test-t", authenticated=True)
    try:
        assert _ask(server.port, host(b"evil.example")).startswith(b"HTTP/1.1 200")
    finally:
        server.stop()


def test_refusals_are_logged_a_few_per_window_with_the_raw_path_escaped(caplog):
    now = [0.0]
    log = RefusalLog(
        logging.getLogger("test.refusals"), "srv", lines=2, window_s=10, clock=lambda: now[0]
    )
    scope = {
        "method": "GET",
        "path": "/a\nFORGED line",  # what ASGI decodes from the raw path: never logged
        "raw_path": b"/a%0aFORGED\r\nline",
        "client": ("10.0.0.1", 5),
    }
    error = HTTPError(401, None, "give the token\nFORGED: too")
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(5):
            log(scope, error)
        now[0] = 11.0
        log(scope, error)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # 2, then the count of the 3 left out, then 1
    assert lines[0] == (
        "srv: refused GET /a%0aFORGED\\x0d\\x0aline from 10.0.0.1: 401 "
        "give the token\\x0aFORGED: too"
    )
    assert "\n" not in "".join(lines) and "\r" not in "".join(lines)
    assert lines[2] == "srv: 3 more refused requests were not logged (at most 2 lines per 10s)"
