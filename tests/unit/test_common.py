"""Unit tests for `raymesh._common`: the helpers the subsystems share (field checks, `Range`,
job-file tables, "module:function", bearer auth and the error shape, `Pending`)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import socket
from dataclasses import dataclass

import pytest

from raymesh._common import (
    TABLES,
    BearerAuth,
    BearerToken,
    HTTPError,
    Pending,
    Range,
    bad,
    check_int,
    check_seconds,
    free_port,
    from_table,
    resolve,
    split_job,
)


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
    token = BearerToken("s3cret")
    assert token.allows(b"Bearer s3cret") and token.allows("bearer s3cret ")
    assert not token.allows(b"Bearer wrong") and not token.allows(b"s3cret")
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
        app, "s3cret", paths=("/api/",), refused=lambda scope, e: refused.append(scope["path"])
    )
    assert _call(guarded, "/healthz")[0] == 200
    assert _call(guarded, "/api/x", b"Bearer s3cret")[0] == 200
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
