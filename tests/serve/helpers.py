"""Models and clients for the serve tests (importable by the replicas' procs)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import ssl
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from raymesh.train import Context
from raymesh.train.checkpoint import Checkpointer


def slow_or_failing(x: torch.Tensor) -> torch.Tensor:
    """Inputs [a, s]: sleeps max(s) seconds per batch (a slow model on demand); an input with
    a > 1000 makes the whole batch raise, as a model does on an input it cannot take."""
    if bool((x[:, 0] > 1000).any()):
        raise ValueError("input too large for this model")
    time.sleep(float(x[:, 1].max()))
    return x * 2


def alphabet(model, prompt: str, max_tokens: int, temperature: float, seed: int):
    """A generate function whose next token is a function of the text so far (as a greedy
    model's is): the letter at (its length mod 26), one every 20 ms. A stream resumed from
    the text already sent goes on exactly as the uninterrupted one; one restarted from the
    prompt repeats itself."""
    text = prompt
    for _ in range(max_tokens):
        time.sleep(0.02)
        piece = chr(ord("a") + len(text) % 26)
        text += piece
        yield piece


def mlp_checkpoint(dir: Path, seed: int) -> Path:
    """A raymesh.train checkpoint of raymesh.examples.mlp's model, with weights from `seed`,
    saved by the training checkpointer (one process, no process group)."""
    from raymesh.examples.mlp import build

    torch.manual_seed(seed)
    ctx = Context.alone()
    task = build(ctx)
    Checkpointer(dir, keep=1).save(
        seed,
        task.model,
        task.optimizer,
        world_size=1,
        strategy="ddp",
        config={},
        data_position=0,
        rank=0,
    )
    return dir


def mlp_outputs(dir: Path, xs: list[list[float]]) -> list[list[float]]:
    """What raymesh.examples.mlp's model with the checkpoint at `dir` answers for `xs`."""
    from raymesh.examples.mlp import build
    from raymesh.train.checkpoint import export_state_dict

    ctx = Context.alone()
    model = build(ctx).model
    model.load_state_dict(export_state_dict(Checkpointer(dir).latest()))  # type: ignore[arg-type]
    with torch.inference_mode():
        out: list[list[float]] = model(torch.tensor(xs)).tolist()
    return out


class Client:
    """Keep-alive HTTP/1.1 (HTTPS for an https:// URL, trusting `cafile`) to one server;
    `post` returns (status, headers, JSON body)."""

    def __init__(
        self, url: str, token: str | None = None, timeout: float = 30, cafile: Path | None = None
    ) -> None:
        parsed = urlparse(url)
        self.conn: http.client.HTTPConnection
        if parsed.scheme == "https":
            context = ssl.create_default_context(cafile=None if cafile is None else str(cafile))
            self.conn = http.client.HTTPSConnection(
                parsed.hostname, parsed.port, timeout=timeout, context=context
            )
        else:
            self.conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)
        self.headers = {"Content-Type": "application/json"}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"

    def request(self, method: str, path: str, body: Any = None, raw: bytes | None = None):
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        self.conn.request(method, path, body=data, headers=self.headers)
        response = self.conn.getresponse()
        payload = response.read()
        try:
            parsed = json.loads(payload)
        except ValueError:
            parsed = payload.decode(errors="replace")
        return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed

    def post(self, path: str, body: Any = None, raw: bytes | None = None):
        return self.request("POST", path, body, raw)

    def close(self) -> None:
        self.conn.close()


def load(url: str, token: str | None, bodies: list[Any], clients: int) -> list[tuple[int, Any]]:
    """POST every body to /v1/predict from `clients` threads at once, each on its own
    connection; (status, JSON) per body, in order."""
    out: list[Any] = [None] * len(bodies)

    def work(k: int) -> None:
        client = Client(url, token)
        try:
            for i in range(k, len(bodies), clients):
                status, _, payload = client.post("/v1/predict", bodies[i])
                out[i] = (status, payload)
        finally:
            client.close()

    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(work, k) for k in range(clients)]:
            f.result(timeout=120)
    return out
