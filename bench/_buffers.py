"""Buffer reads between two procs on one host, for `bench/messaging.py` (`--buffers`, `--big`).

One proc lends a byte tensor, the other ends with its bytes in a tensor of its own, three ways:
- `rdma_read_into`: raymesh's `RDMABuffer(src)`, handed over once; each read is
  `buf.read_into(dst).get()` in the reader (one-sided: the kernel copies between the procs);
- `endpoint_arg`: the owner calls the reader's endpoint with `src` as its argument (through Ray's
  object store, as any large argument), and the endpoint copies it into `dst`;
- `monarch_rdma`: torchmonarch's `RDMABuffer` on its TCP path (no RDMA NIC here), the same
  reads, in a subprocess of its own; "not installed" without the `bench` extra.
Each row is timed in the proc that starts the copy, from the request to the bytes in `dst`.
The methods alternate read by read, so machine noise hits them alike.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

SIZES = {"64MiB": 64 << 20, "1GiB": 1 << 30}
REPS = {"64MiB": 10, "1GiB": 3}
QUICK_REPS = {"64MiB": 3, "1GiB": 2}
NOT_INSTALLED = "not installed (torchmonarch is not on this machine)"


def make_bench_class(base: type, endpoint: Callable[[Any], Any], buffer_cls: type) -> type:
    """The two procs' actor, on raymesh's or Monarch's Actor and RDMABuffer (same names)."""

    class BufferBench(base):  # type: ignore[misc, valid-type]
        @endpoint
        def lend(self, nbytes: int) -> Any:
            self.src = torch.full((nbytes,), 7, dtype=torch.uint8)
            self.src[-1] = 9  # each reader checks both ends
            self.buf = buffer_cls(self.src)
            return self.buf

        @endpoint
        def prepare(self, nbytes: int) -> None:
            self.dst = torch.ones(nbytes, dtype=torch.uint8)  # its pages touched, not timed

        @endpoint
        def read(self, buf: Any) -> float:
            self.dst.zero_()
            t0 = time.perf_counter()
            buf.read_into(self.dst).get()
            secs = time.perf_counter() - t0
            assert int(self.dst[0]) == 7 and int(self.dst[-1]) == 9, "read_into: wrong bytes"
            return secs

        @endpoint
        def take(self, src: torch.Tensor) -> int:
            self.dst.copy_(src)
            return int(self.dst[-1])

        @endpoint
        def push(self, reader: Any) -> float:
            t0 = time.perf_counter()
            last = reader.take.call_one(self.src).get()
            secs = time.perf_counter() - t0
            assert last == 9, "endpoint argument: wrong bytes"
            return secs

        @endpoint
        def release(self) -> None:
            if getattr(self, "buf", None) is not None:
                self.buf.drop().get()
            self.src = self.buf = self.dst = None

    return BufferBench


def measure(
    spawn: Callable[[type], tuple[Any, Any, Callable[[], None]]],
    cls: type,
    sizes: list[str],
    reps: dict[str, int],
    methods: tuple[str, ...],
) -> dict[str, dict[str, Any]]:
    """Per size and method, the seconds of each read (see the module)."""
    owner, reader, stop = spawn(cls)
    out: dict[str, dict[str, Any]] = {}
    try:
        for size in sizes:
            nbytes = SIZES[size]
            buf = owner.lend.call_one(nbytes).get()
            reader.prepare.call_one(nbytes).get()
            calls = {
                "rdma_read_into": lambda buf=buf: reader.read.call_one(buf).get(),
                "endpoint_arg": lambda: owner.push.call_one(reader).get(),
            }
            calls = {m: calls["rdma_read_into" if m == "monarch_rdma" else m] for m in methods}
            secs: dict[str, list[float]] = {m: [] for m in calls}
            for i in range(reps[size] + 1):  # the first of each faults pages in: not kept
                for method in calls if i % 2 == 0 else reversed(list(calls)):
                    s = calls[method]()
                    if i:
                        secs[method].append(s)
            out[size] = {m: summary(xs, nbytes) for m, xs in secs.items()}
            rates = ", ".join(f"{m} {v['GBps']} GB/s" for m, v in out[size].items())
            log(f"buffers {size}: {rates}")
            owner.release.call_one().get()
            reader.release.call_one().get()
    finally:
        stop()
    return out


def summary(xs: list[float], nbytes: int) -> dict[str, Any]:
    med = statistics.median(xs)
    return {
        "median_s": round(med, 4),
        "min_s": round(min(xs), 4),
        "n": len(xs),
        "GBps": round(nbytes / med / 1e9, 3),
    }


def spawn_raymesh(cls: type) -> tuple[Any, Any, Callable[[], None]]:
    from raymesh import this_host

    procs = this_host().spawn_procs(per_host={"procs": 2}, timeout=300)
    actors = procs.spawn("buffers", cls)
    return actors.slice(procs=0), actors.slice(procs=1), lambda: procs.stop().get()


def spawn_monarch(cls: type) -> tuple[Any, Any, Callable[[], None]]:
    from monarch.actor import this_host

    procs = this_host().spawn_procs(per_host={"procs": 2})
    actors = procs.spawn("buffers", cls)
    return actors.slice(procs=0), actors.slice(procs=1), lambda: procs.stop().get()


def run_raymesh(sizes: list[str], quick: bool) -> dict[str, Any]:
    from raymesh import Actor, endpoint
    from raymesh.rdma import RDMABuffer, get_rdma_backend

    cls = make_bench_class(Actor, endpoint, RDMABuffer)
    reps = QUICK_REPS if quick else REPS
    res = measure(spawn_raymesh, cls, sizes, reps, ("rdma_read_into", "endpoint_arg"))
    return {"backend": get_rdma_backend(), **res}


def run_monarch(sizes: list[str], quick: bool) -> dict[str, Any]:
    """torchmonarch's RDMABuffer in a subprocess (its runtime never shares a process with Ray),
    where torchmonarch is installed (the `bench` extra: `pip install -e ".[dev,bench]"`)."""
    if importlib.util.find_spec("monarch") is None:
        return {"skipped": NOT_INSTALLED}
    script = os.path.abspath(__file__)
    cmd = [sys.executable, script, "--monarch", ",".join(sizes), "1" if quick else "0"]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        return {"error": f"monarch subprocess exited with {p.returncode}"}
    return json.loads(lines[-1])


def _monarch_main(sizes: list[str], quick: bool) -> None:
    import monarch
    from monarch.actor import Actor, endpoint
    from monarch.rdma import RDMABuffer

    if hasattr(monarch, "configure"):  # its TCP transport: this bench's hosts have no RDMA NIC
        monarch.configure(rdma_disable_ibverbs=True, rdma_allow_tcp_fallback=True)
    cls = make_bench_class(Actor, endpoint, RDMABuffer)
    reps = QUICK_REPS if quick else REPS
    res = measure(spawn_monarch, cls, sizes, reps, ("monarch_rdma",))
    print(json.dumps({size: r["monarch_rdma"] for size, r in res.items()}), flush=True)


def targets(rm: dict[str, Any], mon: dict[str, Any]) -> dict[str, Any]:
    """Issue 38's target: raymesh's read_into at least Monarch's rate, per size."""
    out: dict[str, Any] = {}
    for size in (s for s in SIZES if s in rm):
        ours = rm[size]["rdma_read_into"]["GBps"]
        theirs = mon.get(size, {}).get("GBps") if "skipped" not in mon else None
        out[f"rdma_read_into_{size}_at_least_monarch_rate"] = {
            "raymesh_GBps": ours,
            "monarch_GBps": theirs if theirs is not None else mon.get("skipped", "no figure"),
            "met": None if theirs is None else ours >= theirs,
        }
        out[f"rdma_read_into_{size}_over_endpoint_arg_rate"] = round(
            ours / rm[size]["endpoint_arg"]["GBps"], 2
        )
    return out


def log(msg: str) -> None:
    print(f"[messaging] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--monarch"]:
    _monarch_main(sys.argv[2].split(","), sys.argv[3] == "1")
