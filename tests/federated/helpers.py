"""Clients for the federated tests (importable by the client procs): the benchmark's task,
with clients that fail on purpose; FedAvg by hand; client hosts in the test's own process
(`LocalFederation`, for the tests that need no Ray); a raw HTTP edge client, and a request sent
a piece at a time (`Upload`)."""

from __future__ import annotations

import http.client
import json
import os
import pickle
import signal
import socket
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from raymesh.examples import fedmlp
from raymesh.federated import Client, RunConfig
from raymesh.federated.federation import Federation
from raymesh.federated.protocol.client import Layout
from raymesh.federated.protocol.messages import Participant, decode, encode
from raymesh.federated.simulation.host import HostProc

RAISES, NAN, KILLS, HANGS = 3, 5, 6, 1  # the cids that misbehave


def _raises(model: Any, data: Any, config: Mapping[str, Any]) -> int:
    raise RuntimeError("this client's data loader broke")


def _nan(model: Any, data: Any, config: Mapping[str, Any]) -> int:
    fedmlp.train(model, data, config)
    with torch.no_grad():
        next(iter(model.parameters())).view(-1)[0] = float("nan")
    return len(data[1])


def _kills(model: Any, data: Any, config: Mapping[str, Any]) -> Any:
    if config["round"] == 2:  # the proc hosting this client dies mid-round (a real SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    return fedmlp.train(model, data, config)


def faulty(cid: int) -> Client:
    """fedmlp's clients, except that RAISES raises and NAN sends NaN."""
    client = fedmlp.client_fn(cid)
    train = {RAISES: _raises, NAN: _nan}.get(cid, fedmlp.train)
    return Client(model=client.model, data=client.data, train_fn=train)


def _hangs(model: Any, data: Any, config: Mapping[str, Any]) -> Any:
    if config["round"] == 1:  # stuck far past the round's timeout
        time.sleep(120)
    return fedmlp.train(model, data, config)


def hanger(cid: int) -> Client:
    """fedmlp's clients, except that HANGS hangs in round 1."""
    client = fedmlp.client_fn(cid)
    train = _hangs if cid == HANGS else fedmlp.train
    return Client(model=client.model, data=client.data, train_fn=train)


def killer(cid: int) -> Client:
    """fedmlp's clients, except that KILLS SIGKILLs its proc in round 2."""
    client = fedmlp.client_fn(cid)
    train = _kills if cid == KILLS else fedmlp.train
    return Client(model=client.model, data=client.data, train_fn=train)


def by_hand(cids: list[int], round_: int = 1) -> np.ndarray:
    """Round `round_` of FedAvg over `cids` from fedmlp's initial model, computed here: the
    example-weighted mean of each client's weights after its local training."""
    model = fedmlp.build_model()
    layout = Layout.of(model.state_dict())
    start = layout.flatten(model.state_dict())
    total, n_total = np.zeros_like(start, dtype=np.float64), 0
    for c in cids:
        client = fedmlp.client_fn(c)
        out = client.train_fn(client.model, client.data, {"round": round_, "client": c})
        total += out["num_examples"] * layout.flatten(client.model.state_dict()).astype(np.float64)
        n_total += out["num_examples"]
    return total / n_total


def fedavg_by_hand(rounds: list[list[int]]) -> np.ndarray:
    """FedAvg over fedmlp from its initial model, computed here: round r (from 1) is the
    example-weighted mean of the weights each client of `rounds[r - 1]` reaches by training
    from the previous round's global weights, kept in float32 as the run keeps them."""
    model = fedmlp.build_model()
    weights = Layout.of(model.state_dict()).flatten(model.state_dict())
    for r, cids in enumerate(rounds, start=1):
        weights = fedavg_round(weights, cids, r)
    return weights.astype(np.float64)


def fedavg_round(start: np.ndarray, cids: list[int], round_: int) -> np.ndarray:
    """Round `round_` of FedAvg over fedmlp's clients `cids` from the flat float32 weights
    `start`: the example-weighted mean of the deltas their local training makes, added in
    float32 (bench/chaos.py checks each applied round of a faulted run with it)."""
    layout = Layout.of(fedmlp.build_model().state_dict())
    total, n_total = np.zeros(layout.size, np.float64), 0
    for c in cids:
        client = fedmlp.client_fn(c)
        state = client.model.state_dict()
        for name, value in layout.unflatten(start).items():
            state[name].copy_(torch.from_numpy(value))
        out = client.train_fn(client.model, client.data, {"round": round_, "client": c})
        trained = layout.flatten(client.model.state_dict()).astype(np.float64)
        total += out["num_examples"] * (trained - start)
        n_total += out["num_examples"]
    return (start + (total / n_total).astype(np.float32)).astype(np.float32)


# --- clients in this process, for the tests that need no Ray ---------------------------------


class _Answered:
    """A reply already in hand, read as a raymesh Future is."""

    def __init__(self, value: Any = None, error: BaseException | None = None) -> None:
        self.value, self.error = value, error

    def get(self, timeout: float | None = None) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


class LocalHost(HostProc):
    """A client host in the test's own process: the Participant a ClientHost runs, answering
    at once, each message and answer pickled as Ray would send them."""

    def __init__(self, index: int, client_fn: Callable[[int], Any]) -> None:
        super().__init__(index, procs=None, actor=None, pid=os.getpid())  # type: ignore[arg-type]
        self.client_fn = client_fn
        self.participant = Participant(self.client_fn)

    def send(self, msg: Any) -> _Answered:
        try:
            reply = self.participant.handle(pickle.loads(pickle.dumps(msg)))
            return _Answered(pickle.loads(pickle.dumps(reply)))
        except Exception as e:
            return _Answered(error=e)

    def stop(self) -> None:
        pass


class LocalFederation(Federation):
    """A Federation whose client hosts are LocalHosts (`hosts` of them): no Ray, no procs."""

    host = LocalHost

    def _default_hosts(self) -> int:
        return 2  # the real one asks Ray for the free CPUs

    def _spawn(self, index: int) -> HostProc:
        return self.host(index, self.client_fn)


def local_run(client_fn: Callable[[int], Any], strategy: Any, **config: Any) -> Any:
    """`fl.run`'s result, with the clients on LocalHosts."""
    on_round = config.pop("on_round", None)
    return LocalFederation(client_fn, strategy, RunConfig(**config)).run(on_round)


def final(result: Any) -> np.ndarray:
    state = result.state_dict()
    return Layout.of(state).flatten(state).astype(np.float64)


# --- speaking to the edge server as a device ---------------------------------------------------


class RawEdge:
    """An edge client speaking raw HTTP, to send what a real one never would."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token, self.key, self.cid = url, token, "", -1

    def call(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        token: str | None = None,
        key: str | None = None,
        raw: bytes | None = None,
    ) -> tuple[int, Any]:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        return self.http(method, path, data, token=token, key=key)

    def http(
        self,
        method: str,
        path: str,
        data: Any = None,
        *,
        token: str | None = None,
        key: str | None = None,
        chunked: bool = False,
    ) -> tuple[int, Any]:
        """One request with http.client (urllib refuses non-ASCII headers); `data` may be an
        iterable of chunks sent with chunked encoding."""
        parts = urllib.parse.urlsplit(self.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        headers = {
            "Authorization": f"Bearer {self.token if token is None else token}",
            "X-Client-Key": self.key if key is None else key,
        }
        try:
            conn.putrequest(method, path, skip_accept_encoding=True)
            for k, v in headers.items():
                conn.putheader(k, v.encode("utf-8"))
            if chunked:
                conn.putheader("Transfer-Encoding", "chunked")
                conn.endheaders()
                for chunk in data:
                    conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                conn.send(b"0\r\n\r\n")
            else:
                if data is not None:
                    conn.putheader("Content-Length", str(len(data)))
                conn.endheaders(data)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
        finally:
            conn.close()

    def join(self, device: str) -> tuple[int, Any]:
        status, body = self.call("POST", "/v1/join", {"device": device})
        if status == 200:
            self.cid, self.key = body["client"], body["key"]
        return status, body

    def next(self) -> Any:
        """The next message (waiting through 204s)."""
        while True:
            status, body = self.call("GET", f"/v1/next?client={self.cid}")
            if status == 200:
                return decode(body)
            assert status == 204, (status, body)

    def reply(self, answer: Any) -> tuple[int, Any]:
        return self.call("POST", f"/v1/reply?client={self.cid}", {"reply": encode(answer)})

    def upload(self) -> Upload:
        """A POST /v1/reply of this client whose head is sent and whose body is not yet."""
        return Upload(self.url, f"/v1/reply?client={self.cid}", self.token, self.key)


class Upload:
    """One POST over a raw socket, its body sent a chunk at a time (chunked encoding): to hold
    a request open, or to send more than the server reads. http.client cannot read the answer
    of a server that answered and closed while the body was still going out; this can (the
    answer waits in the socket's receive queue)."""

    def __init__(self, url: str, path: str, token: str, key: str) -> None:
        parts = urllib.parse.urlsplit(url)
        assert parts.hostname is not None and parts.port is not None
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=60)
        self.cut = False  # the server stopped reading: it answered and closed
        self.sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {token}"
            f"\r\nX-Client-Key: {key}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n".encode()
        )

    def send(self, data: bytes) -> bool:
        """Send `data` as one chunk; False (and nothing sent) once the server stopped reading."""
        if not self.cut:
            try:
                self.sock.sendall(b"%x\r\n%s\r\n" % (len(data), data))
            except OSError:  # it answered and closed: the answer is in the receive queue
                self.cut = True
        return not self.cut

    def response(self, *, finish: bool = True, timeout: float = 60.0) -> tuple[int, Any]:
        """End the body (`finish`), then read the answer: (status, JSON body)."""
        if finish:
            self.send(b"")  # the last chunk
        self.sock.settimeout(timeout)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < self._end(data):
                got = self.sock.recv(65536)
                if not got:
                    break
                data += got
        finally:
            self.sock.close()
        head, _, body = data.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        body = body[: self._end(data) - len(head) - 4]  # what follows answers the body's rest
        return status, json.loads(body) if body else None

    @staticmethod
    def _end(data: bytes) -> int:
        head, _, _ = data.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                return len(head) + 4 + int(value)
        return len(data) + 1  # no length: read until the server closes
