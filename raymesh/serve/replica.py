"""A replica: one actor on a proc of its own, holding the model and answering batches.

The replica pool (raymesh.serve.pool) starts and stops replicas; a replica only computes. An
actor runs one message at a time, so a batch, a token stream and a reload never overlap on one
replica: a reload lands between two batches, and a batch sees either the old weights or the new.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from raymesh.actor import Actor, Port, ProcMesh, endpoint, host_mesh
from raymesh.serve.model import LoadedModel, ModelInfo, ModelSpec

__all__ = ["Replica", "ReplicaProc", "spawn_replica"]


class Replica(Actor):
    """Loads `spec` in its constructor (a spawn that fails to load raises ActorError)."""

    def __init__(self, spec: ModelSpec, cpus: float, gpus: bool) -> None:
        torch.set_num_threads(max(1, int(cpus)))
        device = torch.device("cuda") if gpus and torch.cuda.is_available() else torch.device("cpu")
        self.model = LoadedModel(spec, device)

    @endpoint
    def info(self) -> tuple[ModelInfo, int]:
        return self.model.info, os.getpid()

    @endpoint
    def predict(self, inputs: list[Any]) -> tuple[list[Any], dict[int, tuple[str, str]], float]:
        """One output per input (None where the model failed on it), the failures as
        {index: (exception type, message)}, and the seconds the model took. Plain lists, not
        objects: this is the reply of every batch."""
        started = time.perf_counter()
        values, errors = self.model.predict(inputs)
        return values, errors, time.perf_counter() - started

    @endpoint
    def generate(
        self, prompt: str, max_tokens: int, temperature: float, seed: int, port: Port[Any]
    ) -> int:
        """Sends ("text", piece) for each token, then ("end", None), or ("error", (type,
        message)) if the model raised; returns the tokens sent."""
        sent = 0
        try:
            for piece in self.model.generate(prompt, max_tokens, temperature, seed):
                port.send(("text", piece))
                sent += 1
                if sent >= max_tokens:
                    break
        except Exception as e:
            port.send(("error", (type(e).__name__, str(e)[:500])))
            return sent
        port.send(("end", None))
        return sent

    @endpoint
    def reload(self, spec: ModelSpec) -> ModelInfo:
        """Load `spec` and swap it in; if loading fails, the old model keeps serving."""
        self.model = LoadedModel(spec, self.model.device)
        return self.model.info


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
    name: str, spec: ModelSpec, *, cpus: float, gpus: bool, timeout: float
) -> ReplicaProc:
    """Start one replica on the host with the most room (blocking; raises PlacementError when
    the cluster has no room within `timeout`, ActorError when the model fails to load)."""
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
        actor = procs.spawn("replica", Replica, spec, cpus, gpus)
        info, pid = actor.info.call_one().get(timeout=timeout)
    except BaseException:
        procs.stop(timeout=10.0)
        raise
    return ReplicaProc(name, procs, actor, info, pid)
