"""The edge client: one real device taking part in a federated run over HTTP(S).

    RAYMESH_FL_TOKEN=T raymesh federated client --server https://HOST:PORT \
        --client mymodule:client_fn [--ca-file server-cert.pem] [--device DEVICE-ID]

or, on a device with only torch, NumPy and cryptography installed (no Ray, no raymesh), with
this file and the client's side of the protocol (../protocol/: client.py, messages.py,
privacy.py, secagg.py and shamir.py) copied into one folder:

    python device.py --server https://HOST:PORT --token-file token.txt --client mymodule:client_fn

(Run in place, as `python raymesh/federated/edge/device.py`, it loads them from ../protocol/.)

The token comes from `--token-file` (its first line) or `$RAYMESH_FL_TOKEN`. `--token T` works
too, with a warning: every user of the machine can read a command line (`ps`). Sending the
token over plain http:// to a host other than this one warns once: anyone on the path reads it.

`client_fn(cid)` builds this device's client (any object with `model`, `data` and
`train_fn`, e.g. raymesh.federated.Client); its data never leaves the device. The client
joins, then long-polls for the round's messages and answers each (with secure aggregation on,
only its masked update leaves the device), until the server says the run is over. It speaks
only HTTP(S) with the standard library (urllib); `--ca-file` trusts a server whose certificate
is self-signed (or from a private CA), and a certificate that does not verify ends the client at
once rather than being retried. `--device` is this device's id for enrolment (one enrolment per
device id; default: host name and process id). A message it cannot answer (a share it cannot
decrypt is skipped, not fatal) is logged and left unanswered: the server drops this client from
that round and the next round is answered as usual.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import ipaddress
import json
import logging
import os
import socket
import ssl
import sys
import time
import types
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

if __package__:
    from ..protocol.messages import Done, Participant, decode, encode
else:  # run as a file: load the protocol's modules as a package of their own, without raymesh,
    # from this file's folder (a device's copy) or else from ../protocol/ (run in place)
    _here = os.path.dirname(os.path.abspath(__file__))
    _pkg = types.ModuleType("_raymesh_edge")
    _pkg.__path__ = [_here, os.path.join(os.path.dirname(_here), "protocol")]
    sys.modules["_raymesh_edge"] = _pkg
    _protocol = importlib.import_module("_raymesh_edge.messages")
    Done, Participant = _protocol.Done, _protocol.Participant  # type: ignore[misc]
    decode, encode = _protocol.decode, _protocol.encode

__all__ = ["TOKEN_ENV", "EdgeClient", "load", "main", "token_from"]

logger = logging.getLogger("raymesh.federated.edge")

TOKEN_ENV = "RAYMESH_FL_TOKEN"  # the token, where neither --token nor --token-file is given


class ServerGone(RuntimeError):
    """The server did not answer for `give_up_s` seconds."""


class Untrusted(RuntimeError):
    """The server's certificate does not verify (give --ca-file for a self-signed one)."""


def _loopback(url: str) -> bool:
    """Whether `url`'s host is this machine (what goes there never crosses a network)."""
    host = urllib.parse.urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name: it may resolve anywhere
        return False


def load(spec: str) -> Callable[[int], Any]:
    """`module:function` or `path/to/file.py:function`."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ValueError(f"--client {spec!r}: give module:function or path/file.py:function")
    if where.endswith(".py"):
        mod_spec = importlib.util.spec_from_file_location("_raymesh_edge_client", where)
        if mod_spec is None or mod_spec.loader is None:
            raise ValueError(f"--client {spec!r}: cannot load {where}")
        module = importlib.util.module_from_spec(mod_spec)
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--client {spec!r}: {where} has no function {name!r}")
    return fn


class EdgeClient:
    """Joins `server` with `token` as device `device` and answers its messages until Done.
    `ca_file`: a PEM file of certificates to trust for an https:// server (default: the
    system's)."""

    def __init__(
        self,
        server: str,
        token: str,
        client_fn: Callable[[int], Any],
        *,
        timeout_s: float = 60.0,
        give_up_s: float = 120.0,
        ca_file: str | None = None,
        device: str | None = None,
    ) -> None:
        self.server, self.token = server.rstrip("/"), token
        self.client_fn, self.timeout_s, self.give_up_s = client_fn, timeout_s, give_up_s
        self.device = device or f"{socket.gethostname()}-{os.getpid()}"
        self.cid: int | None = None
        self._key = ""
        self.rounds = 0
        self._tls: ssl.SSLContext | None = None
        if self.server.startswith("https://"):
            self._tls = ssl.create_default_context(cafile=ca_file)
        elif ca_file is not None:
            raise ValueError(f"--ca-file {ca_file}: the server {server} is not https://")
        elif not _loopback(self.server):  # once, here: every request would carry it
            logger.warning(
                "raymesh edge client: %s is plain http: the token, this device's key and its "
                "updates cross the network in clear, for anyone on the path to read; use "
                "https:// (the server's --tls-cert/--tls-key, and --ca-file here)",
                self.server,
            )

    def _request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """One HTTP request, retried while the server cannot be reached (up to give_up_s)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}", "X-Client-Key": self._key}
        if data is not None:
            headers["Content-Type"] = "application/json"
        deadline = time.monotonic() + self.give_up_s
        while True:
            req = urllib.request.Request(self.server + path, data, headers, method=method)
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s, context=self._tls) as r:
                    raw = r.read()
                    return r.status, json.loads(raw) if raw else None
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:500]
                if e.code in (401, 403, 404):
                    raise PermissionError(f"{method} {path}: HTTP {e.code}: {detail}") from None
                return e.code, {"error": detail}
            except urllib.error.URLError as e:
                if isinstance(e.reason, ssl.SSLCertVerificationError):  # retrying cannot help
                    raise Untrusted(
                        f"{self.server}: its certificate does not verify ({e.reason.verify_message}"
                        "): give --ca-file with the server's certificate"
                    ) from None
                self._wait(deadline, e)
            except (ConnectionError, TimeoutError) as e:
                self._wait(deadline, e)

    def _wait(self, deadline: float, error: Exception) -> None:
        if time.monotonic() > deadline:
            raise ServerGone(f"{self.server} unreachable for {self.give_up_s:g} s: {error}")
        time.sleep(1.0)

    def run(self) -> int:
        """Returns the number of messages answered."""
        status, joined = self._request("POST", "/v1/join", {"device": self.device})
        if status != 200:
            raise RuntimeError(f"join refused: HTTP {status}: {joined}")
        self.cid, self._key = int(joined["client"]), joined["key"]
        client = self.client_fn(self.cid)
        participant = Participant(lambda cid: client)
        logger.info("raymesh edge client %d joined %s", self.cid, self.server)
        answered = 0
        while True:
            status, body = self._request("GET", f"/v1/next?client={self.cid}")
            if status == 204 or body is None:
                continue
            if status != 200:
                raise RuntimeError(f"polling failed: HTTP {status}: {body}")
            try:
                msg = decode(body)
                if isinstance(msg, Done):
                    logger.info("raymesh edge client %d: %s", self.cid, msg.reason)
                    return answered
                reply = participant.handle(msg)
            except Exception as e:  # unanswerable: the server drops us from this round only
                logger.warning("raymesh edge client %d: cannot answer: %r", self.cid, e)
                continue
            status, body = self._request(
                "POST", f"/v1/reply?client={self.cid}", {"reply": encode(reply)}
            )
            if status != 200:  # refused or too late: this round goes on without us
                logger.warning("raymesh edge client %d: answer refused: %s", self.cid, body)
            answered += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="raymesh federated client", description=__doc__)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--server", required=True, help="the federated server's URL")
    ap.add_argument("--token", help=TOKEN_HELP)
    ap.add_argument("--client", required=True, help="module:function building this client")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    ap.add_argument(
        "--threads", type=int, help="torch threads (default torch's; 1 when devices share cores)"
    )
    add_client_options(ap)


TOKEN_HELP = (
    f"the server's bearer token; other users can read it in the process list (ps): prefer "
    f"--token-file or ${TOKEN_ENV}"
)


def add_client_options(ap: argparse.ArgumentParser) -> None:
    """--token-file, --ca-file and --device (shared with `raymesh federated client`)."""
    ap.add_argument(
        "--token-file", help=f"a file whose first line is the bearer token (or ${TOKEN_ENV})"
    )
    ap.add_argument("--ca-file", help="PEM certificate(s) to trust for an https:// server")
    ap.add_argument("--device", help="this device's id for enrolment (default: host-pid)")


def token_from(args: argparse.Namespace) -> str | None:
    """The bearer token: `--token` (with a warning: a command line is public to the
    machine's users), else `--token-file`'s first line, else $RAYMESH_FL_TOKEN, else None.
    ValueError for both flags at once, or a file without a token."""
    if args.token and args.token_file:
        raise ValueError("give --token-file or --token, not both (--token-file: ps cannot see it)")
    if args.token:
        logger.warning(
            "raymesh federated client: --token is readable by every user of this machine in "
            "the process list (ps); give --token-file or $%s instead",
            TOKEN_ENV,
        )
        return str(args.token)
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"--token-file {args.token_file}: its first line holds no token")
        return token
    return os.environ.get(TOKEN_ENV) or None


def run_from_args(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        token = token_from(args)
    except (ValueError, OSError) as e:
        print(f"raymesh federated client: {e}", file=sys.stderr)
        return 2
    if not token:
        print(
            f"raymesh federated client: give --token-file (or ${TOKEN_ENV}) with the server's "
            "token",
            file=sys.stderr,
        )
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    try:
        edge = EdgeClient(
            args.server,
            token,
            load(args.client),
            timeout_s=args.timeout,
            ca_file=args.ca_file,
            device=args.device,
        )
        answered = edge.run()
    except (PermissionError, ServerGone, RuntimeError, ValueError, OSError) as e:
        print(f"raymesh federated client: {e}", file=sys.stderr)
        return 1
    print(f"edge client {edge.cid}: answered {answered} messages")
    return 0


if __name__ == "__main__":
    sys.exit(main())
