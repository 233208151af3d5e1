"""A client host: one actor on a proc of its own, holding many simulated clients as state.

A client is not a process: `client_fn(cid)` builds it on first use and the host keeps the
most recently used ones, so a few procs carry thousands of clients. The host answers the
round's messages (raymesh.federated.protocol.messages) for the clients it is sent, one after
another, and sums their masked updates before replying, so one vector per proc crosses the
network.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from raymesh.actor import Actor, ProcMesh, endpoint, host_mesh
from raymesh.federated.protocol.messages import Message, Participant

__all__ = ["ClientHost", "HostProc", "spawn_host"]


class ClientHost(Actor):
    def __init__(self, client_fn: Callable[[int], Any], keep: int) -> None:
        torch.set_num_threads(1)  # many small models: threads would only contend
        self._client_fn, self._keep = client_fn, keep
        self._clients: OrderedDict[int, Any] = OrderedDict()
        self._participant = Participant(self._client)

    def _client(self, cid: int) -> Any:
        if cid in self._clients:
            self._clients.move_to_end(cid)
        else:
            self._clients[cid] = self._client_fn(cid)
            if len(self._clients) > self._keep:
                self._clients.popitem(last=False)
        return self._clients[cid]

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def step(self, msg: Message) -> Any:
        return self._participant.handle(msg)


class HostProc:
    """A started host: its proc (one per host, so a lost one is replaced alone) and actor."""

    def __init__(self, index: int, procs: ProcMesh, actor: Any, pid: int) -> None:
        self.index, self.procs, self.actor, self.pid = index, procs, actor, pid

    def send(self, msg: Message) -> Any:
        return self.actor.step.call_one(msg)

    def __repr__(self) -> str:
        return f"client proc {self.index} (pid {self.pid})"

    def stop(self) -> None:
        try:
            self.procs.stop().get(timeout=30)
        except Exception:  # already gone: nothing left to release
            pass


def spawn_host(
    index: int, client_fn: Callable[[int], Any], *, keep: int, cpus: float, timeout: float
) -> HostProc:
    """Start host `index` on the host machine with the most room (blocking)."""
    hosts = host_mesh()
    free = hosts.free_procs(cpus_per_proc=cpus)
    node = max(free, key=lambda n: free[n]) if free else hosts.node_ids[0]
    procs = hosts.select_hosts([node]).spawn_procs(
        {"procs": 1},
        name=f"fl-clients{index}",
        cpus_per_proc=cpus,
        timeout=timeout,
        escalate=False,  # the federation drops a lost host's clients and replaces it
    )
    try:
        actor = procs.spawn("clients", ClientHost, client_fn, keep)
        pid = actor.pid.call_one().get(timeout=timeout)
    except BaseException:
        procs.stop()
        raise
    return HostProc(index, procs, actor, pid)
