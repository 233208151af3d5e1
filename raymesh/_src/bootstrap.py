"""Monarch's bootstrap names on a Ray cluster: `run_worker_loop_forever` makes a machine a host,
and `attach_to_workers` returns a host mesh of exactly the hosts it names.

In Monarch a worker listens at its address and the client dials each one. In raymesh every
host is a node of one Ray cluster, so a worker joins the cluster's head (`RAYMESH_ADDRESS`, or
`cluster=`) as a node labelled with its address, and the client picks the nodes with those
labels: the address is the worker's name, the transport is Ray's. Both take Monarch's `ca`:
"trust_all_connections" (as Monarch's own implementation accepts only that); TLS between
hosts is Ray's, set for the whole cluster (docs/cluster.md).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from raymesh._src import backend
from raymesh._src.backend.worker_node import LABEL, label_value, run_node
from raymesh._src.host_mesh import HostMesh

__all__ = ["attach_to_workers", "run_worker_loop_forever"]

CA = bytes | Path | Literal["trust_all_connections"]


def run_worker_loop_forever(
    *,
    address: str,
    ca: CA,
    private_key: bytes | Path | None = None,
    cluster: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
) -> None:
    """Make this machine a host raymesh can use, named `address` (Monarch's worker address,
    such as "tcp://worker-3:26600"): it joins the Ray cluster at `cluster` (default
    `RAYMESH_ADDRESS`) as a node and blocks until the node ends or this process is stopped,
    which ends the node too (its procs die with it; their owners' supervision says so).
    `num_cpus`/`num_gpus` (raymesh's) size the node; by default Ray counts the machine's.
    Raises ValueError for a bad address, `ca` or missing cluster, RuntimeError when the node
    could not start or ended by itself."""
    _check_security(ca, private_key)
    _check_name("address", address)
    head = cluster or os.environ.get("RAYMESH_ADDRESS", "")
    if not head:
        raise ValueError(
            "cluster=None and RAYMESH_ADDRESS is unset: give the Ray cluster's head to join, "
            "cluster='<head>:6379' (a worker joins the cluster; the controller then attaches)"
        )
    status = run_node(address, head, num_cpus, num_gpus)
    if status != 0:
        raise RuntimeError(
            f"the host named {address!r} could not join the cluster at {head!r} or stopped "
            f"(ray start exited with status {status}; its output above says why)"
        )


def attach_to_workers(
    *,
    workers: Sequence[Any],
    ca: CA,
    private_key: bytes | Path | None = None,
    name: str | None = None,
    timeout: float = 60.0,
) -> HostMesh:
    """A host mesh (axis `hosts`) of exactly the machines `run_worker_loop_forever` started
    with these addresses, in this order. A worker may be a string or a `Future` of one
    (Monarch's, for addresses found asynchronously). Waits up to `timeout` seconds for workers
    still joining; fails closed: a worker that has not joined by then raises TimeoutError
    naming it, and no mesh is returned. `name` is Monarch's and only checked."""
    _check_security(ca, private_key)
    if isinstance(workers, str) or not workers:
        raise ValueError(
            f"workers={workers!r}: give a list of the workers' addresses, "
            "workers=['tcp://worker-0:26600', ...]"
        )
    if name is not None and not isinstance(name, str):
        raise TypeError(f"name={name!r}: give a string, or leave it out")
    names = [w.get(timeout=timeout) if hasattr(w, "get") else w for w in workers]
    for w in names:
        _check_name("workers", w)
    if len(set(names)) < len(names):
        raise ValueError(f"workers={names!r}: each worker once (a host is in a mesh once)")
    deadline = time.monotonic() + timeout
    while True:
        by_label = {n.labels.get(LABEL): n for n in backend.nodes()}
        missing = [w for w in names if label_value(w) not in by_label]
        if not missing:
            return HostMesh([by_label[label_value(w)] for w in names])
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"workers {missing} did not join the cluster at {backend.address()} within "
                f"{timeout:g}s: start `run_worker_loop_forever(address=..., "
                "ca='trust_all_connections')` on each with RAYMESH_ADDRESS set to this "
                "cluster, check it can reach the head, or give a longer timeout"
            )
        time.sleep(0.2)


def _check_security(ca: Any, private_key: Any) -> None:
    if ca != "trust_all_connections" or private_key is not None:
        raise ValueError(
            f"ca={ca!r}, private_key={'<given>' if private_key is not None else None}: "
            "raymesh's hosts talk over Ray, whose TLS is set for the whole cluster "
            "(RAY_USE_TLS, RAY_TLS_SERVER_CERT, RAY_TLS_SERVER_KEY, RAY_TLS_CA_CERT on every "
            "node; docs/cluster.md). Pass ca='trust_all_connections' and no private_key"
        )


def _check_name(field: str, worker: Any) -> None:
    if not isinstance(worker, str) or "://" not in worker or worker.endswith("://"):
        raise ValueError(
            f"{field}={worker!r}: give a worker address as Monarch writes it, "
            "'tcp://worker-3:26600' (a name for the host; raymesh does not listen on it)"
        )
    if "*" in worker:
        raise ValueError(
            f"{field}={worker!r}: a wildcard cannot name one host; give its hostname, "
            "'tcp://worker-3:26600'"
        )
