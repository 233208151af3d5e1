"""A replica: one actor on a proc of its own, holding the model and answering batches.

The replica pool (`pool`, beside this) starts and stops replicas; a replica only computes. The
router gives a replica one kind of work at a time: a batch, or token streams, or a reload (a
slot is busy until its batch or reload ends, or holds streams until the last ends), so they
never overlap on one replica: a reload lands between two batches, and a batch sees either the
old weights or the new. A replica whose model can batch its decoding (`LoadedModel.decoder`:
a Hugging Face causal LM generating with `raymesh.train.hf:generate`) takes up to
`max_streams` streams at once, decoded as one batch that streams join and leave between
tokens (`raymesh.serve.model.decoder`); any other takes one stream at a time, on a thread of
its own. Either way the actor stays free to take `cancel`: a stream whose caller is gone (its
deadline passed, or its client left) stops at its next token, and no other stream with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from raymesh.actor import Actor, Port, ProcMesh, concurrent_endpoint, endpoint, host_mesh
from raymesh.serve.model import LoadedModel, ModelInfo, ModelSpec
from raymesh.serve.model.decoder import BatchDecoder

__all__ = ["Replica", "ReplicaProc", "spawn_replica"]

# A stream's pieces after its first go out together, a message at most every _FLUSH_S, and
# the replica's streams together send at most _MESSAGES_PER_S (64 streams: a message each per
# 0.32 s): a message costs more than a token of a batch (an actor message, an event in the
# front), and a reader sees no delay at these rates.
_FLUSH_S = 0.02
_MESSAGES_PER_S = 200


class Replica(Actor):
    """Loads `spec` in its constructor (a spawn that fails to load raises ActorError);
    decodes up to `max_streams` streams as one batch where its model can."""

    def __init__(self, spec: ModelSpec, cpus: float, gpus: bool, max_streams: int = 1) -> None:
        torch.set_num_threads(max(1, int(cpus)))
        device = torch.device("cuda") if gpus and torch.cuda.is_available() else torch.device("cpu")
        self.max_streams = max_streams
        self._load(LoadedModel(spec, device))
        self.streams: dict[str, threading.Event] = {}  # a running stream's stop flag, by id

    def _load(self, model: LoadedModel) -> None:
        old: BatchDecoder | None = getattr(self, "decoder", None)
        self.model = model
        self.decoder = model.decoder(self.max_streams)
        if old is not None:
            old.close()  # a reload comes with no stream running: its thread just ends

    def _info(self) -> ModelInfo:
        streams = 1 if self.decoder is None else self.decoder.max_streams
        return dataclasses.replace(self.model.info, max_streams=streams)

    # Every endpoint is async (an actor's endpoints are one kind, as in Monarch); the blocking
    # ones (a batch, a reload) run on a worker thread so that the proc's loop stays free.
    @endpoint
    async def info(self) -> tuple[ModelInfo, int]:
        return self._info(), os.getpid()

    @endpoint
    async def predict(
        self, inputs: list[Any]
    ) -> tuple[list[Any], dict[int, tuple[str, str]], float]:
        """One output per input (None where the model failed on it), the failures as
        {index: (exception type, message)}, and the seconds the model took. Plain lists, not
        objects: this is the reply of every batch."""
        started = time.perf_counter()
        values, errors = await asyncio.to_thread(self.model.predict, inputs)
        return values, errors, time.perf_counter() - started

    @concurrent_endpoint
    async def generate(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float,
        seed: int,
        port: Port[Any],
        stream_id: str = "",
    ) -> int:
        """Sends ("text", piece) for each token (("texts", [pieces]) for those made since its
        last send: see _FLUSH_S), then ("end", None), or ("error", (type, message)) if the
        model raised; returns the tokens sent. The model runs on a thread of its own (torch's
        inference mode is per thread): the decoder's, with the other streams of its batch, or
        this stream's; the actor meanwhile takes `cancel(stream_id)`, which stops it before
        its next token."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def put(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, (kind, value))

        if self.decoder is not None:
            sequence = self.decoder.submit(prompt, max_tokens, temperature, seed, put)
            self.streams[stream_id] = sequence.stop
        else:
            stop = self.streams[stream_id] = threading.Event()
            self._thread(prompt, max_tokens, temperature, seed, stop, put, stream_id)
        sent, last = 0, -_FLUSH_S
        try:
            while True:
                # The pieces made since the last send go as one message ("texts"), paced after
                # the first (see _FLUSH_S).
                got = [await pieces.get()]
                every = max(_FLUSH_S, len(self.streams) / _MESSAGES_PER_S)
                wait = last + every - loop.time()
                if got[0][0] == "text" and wait > 0:
                    await asyncio.sleep(wait)  # the next pieces join this message
                while not pieces.empty():
                    got.append(pieces.get_nowait())
                texts = [value for kind, value in got if kind == "text"]
                if texts:  # on the actor's loop, where its sends belong
                    port.send(("text", texts[0]) if len(texts) == 1 else ("texts", texts))
                    sent += len(texts)
                    last = loop.time()
                kind, value = got[-1]  # nothing comes after a stream's end
                if kind != "text":
                    if kind != "stopped":
                        port.send((kind, value))
                    return sent
        finally:
            self.streams.pop(stream_id, None)

    def _thread(
        self,
        prompt: str,
        max_tokens: int,
        temperature: float,
        seed: int,
        stop: threading.Event,
        put: Any,
        stream_id: str,
    ) -> None:
        """One stream alone, on a thread of its own: the model's generate function."""

        def run() -> None:
            made, tokens = 0, self.model.generate(prompt, max_tokens, temperature, seed)
            try:
                for piece in tokens:
                    if stop.is_set():
                        return put("stopped", None)
                    put("text", piece)
                    made += 1
                    if made >= max_tokens:
                        break
            except Exception as e:
                return put("error", (type(e).__name__, str(e)[:500]))
            finally:
                tokens.close()  # here: the model's inference mode is this thread's
            put("end", None)

        threading.Thread(target=run, name=f"raymesh-stream-{stream_id}", daemon=True).start()

    @endpoint
    async def cancel(self, stream_id: str) -> bool:
        """Stop stream `stream_id` before its next token; False if it is not running."""
        stop = self.streams.get(stream_id)
        if stop is not None:
            stop.set()
        return stop is not None

    @endpoint
    async def reload(self, spec: ModelSpec) -> ModelInfo:
        """Load `spec` and swap it in; if loading fails, the old model keeps serving."""
        self._load(await asyncio.to_thread(LoadedModel, spec, self.model.device))
        return self._info()


@dataclass
class ReplicaProc:
    """A started replica: its proc, its actor, and what it reported."""

    name: str
    procs: ProcMesh
    actor: Any
    info: ModelInfo
    pid: int

    def stop(self, timeout: float = 10.0) -> None:
        try:
            self.procs.stop(timeout=timeout)
        except Exception:  # already gone: nothing left to release
            pass


def spawn_replica(
    name: str, spec: ModelSpec, *, cpus: float, gpus: bool, timeout: float, max_streams: int = 1
) -> ReplicaProc:
    """Start one replica on the host with the most room (blocking; raises PlacementError when
    the cluster has no room within `timeout`, ActorError when the model fails to load); it
    decodes up to `max_streams` streams at once where its model can (its info says)."""
    hosts = host_mesh()
    free = hosts.free_procs(cpus_per_proc=cpus)
    node = max(free, key=lambda n: free[n]) if free else hosts.node_ids[0]
    procs = hosts.select_hosts([node]).spawn_procs(
        {"gpus" if gpus else "procs": 1},
        name=name,
        cpus_per_proc=cpus,
        timeout=timeout,
        escalate=False,  # the router watches its replicas and replaces them
    )
    try:
        actor = procs.spawn("replica", Replica, spec, cpus, gpus, max_streams)
        info, pid = actor.info.call_one().get(timeout=timeout)
    except BaseException:
        procs.stop(timeout=10.0)
        raise
    return ReplicaProc(name, procs, actor, info, pid)
