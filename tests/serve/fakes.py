"""Replicas without Ray, so that the front and the router run for real (uvicorn, the router's
loop, real HTTP) in a test that starts no proc: `Fakes.start` has `spawn_replica`'s signature
and is passed to `Server(start_replica=...)`, as Ray Train v2's tests swap in a fake worker group.

A fake replica's "weights" are its checkpoint folder's name: folder `w3` answers 3 * x for each
input x (no checkpoint: 1 * x), so an answer says which weights computed it. An input of -1
hangs until the replica is killed, as a hung model does; while `gate` is clear, every batch
waits (a replica busy for as long as the test says).

A fake replica generates "a", "b", "c", ... one token every `token_s` seconds, through an
in-process channel (`open_fake_channel`, the dispatcher's `open_channel`), and stops before its
next token when told to `cancel` its stream; `generating` counts the streams it computes now,
and `most_on_one` the most one replica ever computed at once (the router gives it at most
`max_streams`, what it says it decodes at once: 1 unless a test sets more).
A prompt longer than `context` characters is refused as the real replica refuses one.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from raymesh.actor import ActorError
from raymesh.serve import ModelSpec, ServeConfig
from raymesh.serve.model import ModelInfo, PromptTooLong
from raymesh.serve.routing.replica import ReplicaProc
from raymesh.serve.server import Server
from raymesh.train import TrainConfig
from raymesh.train.checkpoint import Manifest

HANG = -1


def weight_of(checkpoint: str | None) -> float:
    return 1.0 if checkpoint is None else float(Path(checkpoint).name.lstrip("w"))


def fake_checkpoint(folder: Path, build: str | None = None) -> Path:
    """A folder `resolve_checkpoint` takes as a step folder (it has a manifest.json); with
    `build`, a manifest whose job names that build function (no weights: fakes load none)."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest = "{}"
    if build is not None:
        config = TrainConfig(build=build).to_dict()
        manifest = Manifest(
            step=1, world_size=1, strategy="ddp", config=config, data_position=0, files={},
            created=0.0,
        ).to_json()  # fmt: skip
    (folder / "manifest.json").write_text(manifest)
    return folder


class _Endpoint:
    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def call_one(self, *args: Any) -> Any:
        return self.fn(*args)  # a coroutine: the router awaits it as it awaits a Future


class FakeReplica:
    def __init__(self, fakes: Fakes, name: str, spec: ModelSpec, pid: int) -> None:
        self.fakes, self.name, self.spec, self.pid = fakes, name, spec, pid
        self.killed = False
        self.held: list[Any] = []  # inputs of the batch it is computing
        self.predict = _Endpoint(self._predict)
        self.reload = _Endpoint(self._reload)
        self.generate = _Endpoint(self._generate)
        self.cancel = _Endpoint(self._cancel)
        self.stopping: set[str] = set()  # streams told to stop
        self.streaming = 0  # streams it computes now

    def info(self) -> ModelInfo:
        return ModelInfo(
            input_shape=None,
            input_dtype="float32",
            generates=True,
            checkpoint=self.spec.checkpoint,
            device="cpu",
            max_streams=self.fakes.max_streams,
        )

    async def _predict(self, inputs: list[Any]) -> tuple[list[Any], dict[int, Any], float]:
        self.held = inputs
        try:
            while HANG in inputs or not self.fakes.gate.is_set():
                if self.killed:
                    raise RuntimeError(f"{self.name}'s proc died")  # as a SupervisionError
                await asyncio.sleep(0.005)
            if self.killed:
                raise RuntimeError(f"{self.name}'s proc died")
            w = weight_of(self.spec.checkpoint)
            if self.fakes.reloading:  # another replica is swapping its weights right now
                self.fakes.served_during_reload += len(inputs)
            return [w * x for x in inputs], {}, 0.0
        finally:
            self.held = []

    async def _generate(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float,
        seed: int,
        port: FakePort,
        stream_id: str,
    ) -> int:
        # A caller that stops waiting does not stop a real replica: only `cancel` does.
        work = asyncio.ensure_future(self._stream(prompt, max_tokens, port, stream_id))
        return await asyncio.shield(work)

    async def _stream(self, prompt: str, max_tokens: int, port: FakePort, stream_id: str) -> int:
        if len(prompt) > self.fakes.context:
            port.send(("error", (PromptTooLong.__name__, f"prompt: over {self.fakes.context}")))
            return 0
        self.fakes.generating += 1
        self.streaming += 1
        self.fakes.most_on_one = max(self.fakes.most_on_one, self.streaming)
        sent = 0
        try:
            for i in range(max_tokens):
                await asyncio.sleep(self.fakes.token_s)
                if self.killed:
                    raise RuntimeError(f"{self.name}'s proc died")
                if stream_id in self.stopping:
                    return sent
                port.send(("text", chr(ord("a") + (len(prompt) + i) % 26)))
                sent += 1
            port.send(("end", None))
            return sent
        finally:
            self.fakes.generating -= 1
            self.streaming -= 1
            self.fakes.tokens_made += sent

    async def _cancel(self, stream_id: str) -> bool:
        self.stopping.add(stream_id)
        return True

    async def _reload(self, spec: ModelSpec) -> ModelInfo:
        self.fakes.reloading += 1
        try:
            await asyncio.sleep(self.fakes.reload_s)  # loading takes a while: requests overlap
            self.fakes.reloads.append((self.name, spec.checkpoint))
            if self.fakes.fail_reload(self, spec):
                raise ActorError(
                    mesh_name=self.name,
                    rank=0,
                    endpoint="reload",
                    remote_type="raymesh.train.checkpoint.CheckpointError",
                    remote_message=f"{spec.checkpoint} failed to load on {self.name}",
                    remote_traceback="",
                )
            self.spec = spec
            return self.info()
        finally:
            self.fakes.reloading -= 1


class FakePort:
    def __init__(self, queue: asyncio.Queue[Any]) -> None:
        self.queue = queue

    def send(self, value: Any) -> None:
        self.queue.put_nowait(value)


class FakeReceiver:
    def __init__(self, queue: asyncio.Queue[Any]) -> None:
        self.queue = queue

    def recv(self) -> Any:
        return self.queue.get()  # a coroutine: the dispatcher awaits it as it awaits a Future


def open_fake_channel() -> tuple[FakePort, FakeReceiver]:
    """A Channel's two ends within the server's loop (the fakes run there too)."""
    queue: asyncio.Queue[Any] = asyncio.Queue()
    return FakePort(queue), FakeReceiver(queue)


class _Procs:
    def __init__(self, replica: FakeReplica) -> None:
        self.replica = replica

    def kill(self) -> None:
        self.replica.killed = True

    def stop(self, timeout: float = 10.0) -> None:
        self.replica.killed = True


class Fakes:
    """The fake replicas of one app, and the knobs a test turns."""

    def __init__(self, *, reload_s: float = 0.0) -> None:
        self.replicas: list[FakeReplica] = []
        self.gate = threading.Event()
        self.gate.set()
        self.reload_s = reload_s
        self.reloads: list[tuple[str, str | None]] = []  # (replica, checkpoint) per reload call
        self.reloading = 0  # replicas loading weights now
        self.served_during_reload = 0  # inputs answered while a replica was loading
        self.token_s = 0.01  # each generated token takes this long
        self.context = 1000  # the longest prompt, in characters
        self.generating = 0  # streams computing now, on every replica
        self.tokens_made = 0  # tokens generated, on every replica
        self.most_on_one = 0  # the most streams one replica ever computed at once
        self.max_streams = 1  # the streams a replica says it decodes at once
        self._pids = itertools.count(100_000)

    def fail_reload(self, replica: FakeReplica, spec: ModelSpec) -> bool:
        """Whether `replica` fails to load `spec` (a test replaces it)."""
        return False

    def start(
        self,
        name: str,
        spec: ModelSpec,
        *,
        cpus: float,
        gpus: bool,
        timeout: float,
        max_streams: int = 1,
    ) -> ReplicaProc:
        replica = FakeReplica(self, name, spec, next(self._pids))
        self.replicas.append(replica)
        return ReplicaProc(name, _Procs(replica), replica, replica.info(), replica.pid)  # type: ignore[arg-type]

    def live(self) -> list[FakeReplica]:
        return [r for r in self.replicas if not r.killed]


def spec_of(checkpoint: Path | None) -> ModelSpec:
    return ModelSpec(
        model=torch.nn.Identity(), checkpoint=None if checkpoint is None else str(checkpoint)
    ).resolved()


@contextlib.contextmanager
def fake_app(
    checkpoint: Path | None = None,
    fakes: Fakes | None = None,
    spec: ModelSpec | None = None,
    **fields: Any,
) -> Iterator[tuple[Server, Fakes]]:
    """A real server (uvicorn, router, HTTP on a free port) over fake replicas; `spec`: what
    it serves, resolved (default: an nn.Module with `checkpoint`)."""
    fakes = fakes or Fakes()
    config = ServeConfig(port=0, **fields)
    app = Server(
        spec or spec_of(checkpoint),
        router=config.router,
        batch=config.batch,
        front=config.front,
        start_replica=fakes.start,
    )
    app.router.dispatcher.open_channel = open_fake_channel
    app.start()
    try:
        yield app, fakes
    finally:
        fakes.gate.set()
        app.stop()
