"""Messaging benchmark: raymesh vs raw Ray actors vs torchmonarch, in one run on one machine.

Run (from the repository root):
    python bench/messaging.py            # full: 1000 call_one, 300 call-all, 25 tensor sends
    python bench/messaging.py --quick    # smoke run: 100 / 30 / 3
    python bench/messaging.py --sigkill  # only SIGKILL -> SupervisionError (5 kills)
    python bench/messaging.py --buffers  # only the 64 MiB buffer reads (add --big for 1 GiB)

Per system: spawn 4 (and 16) procs until every actor replied, with Ray (for Monarch: the
process) already up; call_one round trip to one actor; call to all 4 (and to all 16) actors +
gather; a 64 MiB float32 tensor sent to one actor and acknowledged, and sent to one actor and
echoed back; and the whole process: a fresh `python` that imports the system, starts it (raymesh:
its local Ray) and spawns 4 procs until every actor replied, timed from before the launch. For
raymesh alone, the milliseconds from SIGKILL of a proc to the SupervisionError of a call pending
on it (5 kills, one proc each; `--sigkill` measures only that). And a 64 MiB buffer read between
two procs (1 GiB too with `--big`): raymesh's `RDMABuffer.read_into`, the same bytes through an
endpoint argument, and torchmonarch's `RDMABuffer` ("not installed" here; see `_buffers.py`).
raymesh and raw Ray run in this process, interleaved in alternating blocks so machine noise hits
both alike; torchmonarch (when installed) runs in a subprocess of its own (`--monarch`) so its
runtime never shares a process with Ray.

raymesh keeps warm procs (`RAYMESH_WARM_PROCS`, here 16, enough for the 16-proc mesh): "Ray
already up" includes them being ready, and after each spawn the bench waits until the pool has
been topped up again, so that no timing shares the 2 cores with procs starting in the background.
Progress goes to stderr; exactly one JSON object goes to stdout at the end.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _buffers

TENSOR_NUMEL = 64 * 2**20 // 4  # 64 MiB of float32
TENSOR_WARMUP = 3  # the first sends fault in fresh object-store pages
SIGKILLS = 5  # procs killed for the SIGKILL -> SupervisionError figure
ANCHORS_PUBLISHED = {
    "torchmonarch_0.7.0": {"call_one_ms": 1.01, "call_all_4_ms": 1.82, "tensor_64MiB_s": 0.21},
    "raw_ray": {"actor_rtt_ms": 0.99},
}
RATIO_LIMIT = 1.2  # raymesh may cost at most this many times raw Ray per message
SPEEDUP_TARGET = 4.0  # raymesh's 64 MiB send must be this many times faster than monarch's
MONARCH_LIMITS = {  # raymesh may take at most this many times torchmonarch's figure
    "spawn_4_s": 1.5,
    "spawn_16_s": 1.5,
    "whole_process_4_s": 2.0,
    "call_one_ms": 1.0,
    "call_all_4_ms": 1.0,
    "call_all_16_ms": 1.0,
}
PUBLISHED = "published anchor (torchmonarch 0.7.0); not installed here"
# torchmonarch 0.7.0's whole process to 4 replies, median of 3, measured by this bench on this
# project's 2-core machine (docs/benchmarks.md): the anchor when it is not installed.
MONARCH_WHOLE_PUBLISHED_S = 0.817


def log(msg: str) -> None:
    print(f"[messaging] {msg}", file=sys.stderr, flush=True)


def check(ok: bool, what: str) -> None:
    if not ok:
        raise RuntimeError(f"check failed: {what}")


def make_bench_class(base: type, endpoint: Callable[[Any], Any]) -> type:
    """The bench actor on `base` (raymesh's or monarch's Actor; `object` for raw Ray)."""

    class BenchActor(base):
        @endpoint
        def ping(self, x: int) -> int:
            return x

        @endpoint
        def recv(self, t: torch.Tensor) -> int:
            t[-1].item()  # touch the data so the transfer is really materialised
            return t.numel()

        @endpoint
        def echo(self, t: torch.Tensor) -> torch.Tensor:
            return t

    return BenchActor


@dataclass
class Ops:
    """One system's actors, as calls the measurements time."""

    call_one: Callable[[int], Any]
    call_all: Callable[[int], list]
    recv: Callable[[torch.Tensor], int]
    echo: Callable[[torch.Tensor], torch.Tensor]
    stop: Callable[[], None]
    n: int  # actors in the mesh


def mesh_ops(actors: Any, stop: Callable[[], None]) -> Ops:
    """Ops for a raymesh or monarch actor mesh (the two share the adverbs)."""
    one = actors.slice(procs=0)
    return Ops(
        call_one=lambda x: one.ping.call_one(x).get(),
        call_all=lambda x: [v for _, v in actors.ping.call(x).get().items()],
        recv=lambda t: one.recv.call_one(t).get(),
        echo=lambda t: one.echo.call_one(t).get(),
        stop=stop,
        n=len(list(actors.ping.call(0).get().items())),  # also the first reply
    )


def settle_pool() -> None:
    """Wait until raymesh's warm procs are all started (its pool refills after a spawn)."""
    from raymesh._src.backend import pool

    check(pool.wait_ready(600), "warm procs did not start within 600 s")


def spawn_raymesh(n: int) -> tuple[Ops, float]:
    from raymesh import Actor, endpoint, this_host

    settle_pool()
    t0 = time.perf_counter()
    # 16 procs start slowly on a small machine (if they start cold): allow more than 60 s
    procs = this_host().spawn_procs(per_host={"procs": n}, timeout=300)
    ops = mesh_ops(procs.spawn("bench", make_bench_class(Actor, endpoint)), procs.stop)
    secs = time.perf_counter() - t0
    settle_pool()
    return ops, secs


def spawn_raw_ray(n: int) -> tuple[Ops, float]:
    import ray

    cls: Any = ray.remote(num_cpus=1)(make_bench_class(object, lambda f: f))  # like a proc
    t0 = time.perf_counter()
    handles = [cls.remote() for _ in range(n)]
    first = ray.get([h.ping.remote(0) for h in handles])
    a = handles[0]

    def stop() -> None:
        for h in handles:
            ray.kill(h, no_restart=True)

    ops = Ops(
        call_one=lambda x: ray.get(a.ping.remote(x)),
        call_all=lambda x: ray.get([h.ping.remote(x) for h in handles]),
        recv=lambda t: ray.get(a.recv.remote(t)),
        echo=lambda t: ray.get(a.echo.remote(t)),
        stop=stop,
        n=len(first),
    )
    return ops, time.perf_counter() - t0


def spawn_monarch(n: int) -> tuple[Ops, float]:
    from monarch.actor import Actor, endpoint, this_host

    t0 = time.perf_counter()
    procs = this_host().spawn_procs(per_host={"procs": n})
    actors = procs.spawn("bench", make_bench_class(Actor, endpoint))
    return mesh_ops(actors, lambda: procs.stop().get()), time.perf_counter() - t0


WHOLE = {
    "raymesh": "from raymesh import Actor, endpoint, this_host",
    "raymesh_runtime_up": "from raymesh import Actor, endpoint, this_host",
    "monarch": "from monarch.actor import Actor, endpoint, this_host",
}
# Ray's own start, for the embedded path's target (<= Ray's start + 2 s): a fresh python
# starting a local Ray as raymesh's embedded start does (loopback, 64 logical CPUs).
RAY_START_SCRIPT = """
import os, time
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
from ray._private import ray_constants
ray_constants.ENABLE_RAY_CLUSTER = False
ray.init(address="local", num_cpus=64, include_dashboard=False, _node_ip_address="127.0.0.1")
print("REPLIED", time.time(), flush=True)
"""
WHOLE_SCRIPT = """
import sys, time
{imp}
class A(Actor):
    @endpoint
    def ping(self, x: int) -> int:
        return x
procs = this_host().spawn_procs(per_host={{"procs": 4}})
replies = [v for _, v in procs.spawn("a", A).ping.call(1).get().items()]
assert replies == [1] * 4, replies
print("REPLIED", time.time(), flush=True)
"""
RUNTIME_WARM = 8  # the local runtime's warm procs in the "runtime up" rows


@contextlib.contextmanager
def local_runtime() -> Iterator[Callable[[], dict[str, str]]]:
    """`raymesh up` in a directory of its own, then `raymesh down`: yields a function that
    waits until the runtime's warm procs are all ready again (a user rerunning a script a few
    seconds later finds them so) and returns the environment a program attaches with."""
    folder = tempfile.mkdtemp(prefix="raymesh-bench-rt-")
    env = dict(os.environ, RAYMESH_RUNTIME_DIR=folder)
    cli = [sys.executable, "-m", "raymesh.cli.main"]
    t0 = time.perf_counter()
    up = [*cli, "up", "--warm", str(RUNTIME_WARM)]  # what it says goes to stderr, as all progress
    subprocess.run(up, env=env, check=True, timeout=300, stdout=sys.stderr)
    log(f"raymesh up in {time.perf_counter() - t0:.1f}s")

    def ready() -> dict[str, str]:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            out = subprocess.run(
                [*cli, "status", "--json"], env=env, capture_output=True, text=True
            )
            warm = (json.loads(out.stdout) or {}).get("warm_procs") or {}
            if warm.get("ready") == RUNTIME_WARM:
                return env
            time.sleep(1.0)
        raise RuntimeError("the runtime's warm procs were not ready within 300 s")

    try:
        yield ready
    finally:
        subprocess.run([*cli, "down"], env=env, timeout=120, stdout=sys.stderr)


def whole_process(runs: int) -> dict[str, Any]:
    """Per system, seconds from launching a fresh python to 4 procs' replies (the process's
    own start, imports, runtime start and spawn; its exit is not timed): the systems take turns,
    `runs` times each, and each gets the summary of its runs. "raymesh" starts the embedded
    Ray (RAYMESH_RUNTIME=0); "raymesh_runtime_up" attaches to a local runtime (`raymesh up`)
    whose warm procs are ready."""
    systems = [s for s in WHOLE if s != "monarch" or importlib.util.find_spec("monarch")]
    systems.append("ray_start")
    secs: dict[str, list[float]] = {s: [] for s in systems}
    with local_runtime() as runtime_ready:
        for i in range(runs):
            for system in systems if i % 2 == 0 else reversed(systems):
                # Every run on a quiet machine: the runtime's pool refilled after the last one.
                env = runtime_ready()
                if system != "raymesh_runtime_up":
                    env = dict(env, RAYMESH_RUNTIME="0")
                script = RAY_START_SCRIPT if system == "ray_start" else WHOLE_SCRIPT
                t0 = time.time()
                p = subprocess.run(
                    [sys.executable, "-c", script.format(imp=WHOLE.get(system, ""))],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    timeout=300,
                    env=env,
                )
                done = [ln for ln in p.stdout.splitlines() if ln.startswith("REPLIED ")]
                check(p.returncode == 0 and bool(done), f"{system} whole process: {p.returncode}")
                secs[system].append(float(done[0].split()[1]) - t0)
                log(f"{system}: whole process to 4 replies in {secs[system][-1]:.2f}s")
    return {s: summary(xs, 1.0) for s, xs in secs.items()}


def summary(xs: list[float], scale: float) -> dict[str, float]:
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]
    med = statistics.median(xs)
    return {"median": round(med * scale, 4), "p90": round(p90 * scale, 4), "n": len(xs)}


def interleaved(
    fns: dict[str, Callable[[int], None]], n: int, warmup: int, blocks: int = 0
) -> dict[str, list[float]]:
    """Time `n` calls of each fn, in alternating blocks (the order flips every block);
    `blocks` 0: about 25 calls a block, at most 10 blocks."""
    for fn in fns.values():
        for i in range(warmup):
            fn(i)
    blocks = blocks or max(1, min(10, n // 25))
    lat: dict[str, list[float]] = {name: [] for name in fns}
    for b in range(blocks):
        order = list(fns.items()) if b % 2 == 0 else list(reversed(fns.items()))
        for name, fn in order:
            for i in range(n // blocks + (b < n % blocks)):
                t = time.perf_counter()
                fn(i)
                lat[name].append(time.perf_counter() - t)
    return lat


def checked(ops: Ops, t: torch.Tensor) -> dict[str, Callable[[int], None]]:
    """The timed calls, each checking its reply."""

    def echo(_: int) -> None:
        back = ops.echo(t)
        check(back.shape == t.shape and back[-1].item() == t[-1].item(), "echo")

    return {
        "call_one": lambda i: check(ops.call_one(i) == i, "ping"),
        "call_all": lambda i: check(ops.call_all(i) == [i] * ops.n, f"call-all({ops.n})"),
        "recv": lambda _: check(ops.recv(t) == TENSOR_NUMEL, "recv numel"),
        "echo": echo,
    }


def measure(spawn: dict[str, Callable[[int], tuple[Ops, float]]], it: dict[str, int]) -> dict:
    """All metrics for the systems in `spawn`: a mesh of 4, then one of 16, measured interleaved."""
    res: dict[str, dict[str, Any]] = {name: {} for name in spawn}
    t = torch.randn(TENSOR_NUMEL, dtype=torch.float32)
    for n in (4, 16):
        ops: dict[str, Ops] = {}
        for name, fn in spawn.items() if n == 4 else reversed(spawn.items()):  # flip who's first
            ops[name], secs = fn(n)
            res[name][f"spawn_{n}_s"] = round(secs, 3)
            check(ops[name].n == n, f"{name}: {ops[name].n} actors answered, not {n}")
            log(f"{name}: {n} procs spawned and answered in {res[name][f'spawn_{n}_s']:.2f}s")
        calls = {k: checked(o, t) for k, o in ops.items()}
        # (metric, call, count, warmup calls, blocks (0: default), scale to the unit)
        plan = [(f"call_all_{n}_ms", "call_all", it["all"], it["warmup"], 0, 1e3)]
        if n == 4:
            plan.insert(0, ("call_one_ms", "call_one", it["one"], it["warmup"], 0, 1e3))
            for call in ("recv", "echo"):  # large sends alternate call by call
                count = it["tensor"]
                plan.append((f"tensor_64MiB_{call}_s", call, count, TENSOR_WARMUP, count, 1.0))
        for metric, call, count, warmup, blocks, scale in plan:
            lat = interleaved({k: c[call] for k, c in calls.items()}, count, warmup, blocks)
            for k, xs in lat.items():
                res[k][metric] = summary(xs, scale)
            log(f"{metric}: " + ", ".join(f"{k} {res[k][metric]['median']}" for k in lat))
        for o in ops.values():
            o.stop()
    return res


def sigkill_to_supervision_error(kills: int) -> dict[str, float]:
    """Milliseconds from SIGKILL of a proc to the SupervisionError of a call pending on it
    (docs/programming-model.md: "within milliseconds"): `kills` procs, each running a long call
    when it is killed, one at a time."""
    from raymesh import Actor, SupervisionError, endpoint, this_host

    class Sleeper(Actor):
        @endpoint
        def sleep(self, seconds: float) -> None:
            time.sleep(seconds)

        @endpoint
        def ping(self) -> int:
            return os.getpid()

    settle_pool()
    # escalate=False: the deaths are this bench's own doing, not news for the fault hook
    procs = this_host().spawn_procs(per_host={"procs": kills}, timeout=300, escalate=False)
    sleepers = procs.spawn("sleepers", Sleeper)
    check(sleepers.ping.call().get(timeout=60).values() == procs.pids, "sleepers' pids")
    secs = []
    for rank, pid in enumerate(procs.pids):
        pending = sleepers.slice(procs=rank).sleep.call_one(60.0)
        time.sleep(0.2)  # the call is running in the proc
        check(not pending.done(), "the sleep returned early")
        t0 = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        try:
            pending.get(timeout=30)
        except SupervisionError as e:
            secs.append(time.perf_counter() - t0)
            check(e.failure.kind == "proc_died", f"failure kind {e.failure.kind}")
        else:
            check(False, "a call on a SIGKILLed proc returned")
        log(f"SIGKILL -> SupervisionError in {secs[-1] * 1e3:.1f} ms")
    procs.stop()
    settle_pool()
    return summary(secs, 1e3)


def run_monarch(quick: bool) -> dict[str, Any]:
    if importlib.util.find_spec("monarch") is None:
        return {"skipped": "torchmonarch not installed"}
    log("torchmonarch: measuring in a subprocess")
    cmd = [sys.executable, os.path.abspath(__file__), "--monarch"] + (["--quick"] * quick)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=1800)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        return {"error": f"monarch subprocess exited with {p.returncode}"}
    return json.loads(lines[-1])


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def build_report(res: dict[str, dict], mon: dict[str, Any]) -> dict[str, Any]:
    def med(system: dict, key: str) -> float | None:
        value = system.get(key)
        return value.get("median") if isinstance(value, dict) else value

    rm, raw = res["raymesh"], res["raw_ray"]
    ratios: dict[str, float | None] = {}
    targets: dict[str, Any] = {}
    for k in ("call_one", "call_all_4", "call_all_16"):
        r = ratios[f"raymesh_over_raw_ray_{k}"] = ratio(med(rm, f"{k}_ms"), med(raw, f"{k}_ms"))
        met = r is not None and r <= RATIO_LIMIT
        targets[f"{k}_within_{RATIO_LIMIT}x_raw_ray"] = {"ratio": r, "met": met}
    # Issue 10's targets against torchmonarch, measured in this run.
    for key, limit in MONARCH_LIMITS.items():
        r = ratios[f"raymesh_over_monarch_{key}"] = ratio(med(rm, key), med(mon, key))
        targets[f"{key}_within_{limit}x_monarch"] = {
            "ratio": r,
            "met": r is not None and r <= limit,
        }
    mon_s, rm_s = med(mon, "tensor_64MiB_recv_s"), med(rm, "tensor_64MiB_recv_s")
    ratios["monarch_over_raymesh_64MiB"] = ratio(mon_s, rm_s)
    source = "measured in this run"
    if mon_s is None:
        mon_s, source = ANCHORS_PUBLISHED["torchmonarch_0.7.0"]["tensor_64MiB_s"], PUBLISHED
    speedup = ratio(mon_s, rm_s)
    targets[f"tensor_64MiB_{SPEEDUP_TARGET}x_faster_than_monarch"] = {
        "monarch_s": mon_s,
        "monarch_source": source,
        "speedup": speedup,
        "met": speedup is not None and speedup >= SPEEDUP_TARGET,
    }
    return {"raymesh": rm, "raw_ray": raw, "monarch": mon, "ratios": ratios, "targets": targets}


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def sigkill_only(loadavg: tuple[float, float, float]) -> dict[str, Any]:
    """`--sigkill`: that one figure, in the report's shape."""
    os.environ.setdefault("RAYMESH_WARM_PROCS", str(SIGKILLS))  # the spawn takes warm procs
    from raymesh._src.backend import ensure_ray, shutdown

    ensure_ray()
    figure = sigkill_to_supervision_error(SIGKILLS)
    shutdown()
    return {
        "bench": "messaging",
        "only": "sigkill",
        "cpus": os.cpu_count(),
        "loadavg_start_end": [loadavg, os.getloadavg()],
        "versions": {d: version(d) for d in ("raymesh", "ray", "torch")},
        "raymesh": {"sigkill_to_supervision_error_ms": figure},
    }


def buffers_only(
    loadavg: tuple[float, float, float], sizes: list[str], quick: bool
) -> dict[str, Any]:
    """`--buffers`: the buffer reads alone, in the report's shape."""
    os.environ.setdefault("RAYMESH_WARM_PROCS", "2")  # the two procs come warm
    monarch = _buffers.run_monarch(sizes, quick)  # before Ray starts, as the full run does
    from raymesh._src.backend import ensure_ray, shutdown

    ensure_ray()
    settle_pool()
    raymesh = _buffers.run_raymesh(sizes, quick)
    shutdown()
    return {
        "bench": "messaging",
        "only": "buffers",
        "quick": quick,
        "cpus": os.cpu_count(),
        "loadavg_start_end": [loadavg, os.getloadavg()],
        "versions": {d: version(d) for d in ("raymesh", "ray", "torch", "torchmonarch")},
        "buffers": {
            "raymesh": raymesh,
            "monarch": monarch,
            "targets": _buffers.targets(raymesh, monarch),
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument(
        "--sigkill", action="store_true", help="only SIGKILL -> SupervisionError, for raymesh"
    )
    ap.add_argument(
        "--whole", action="store_true", help="only the whole-process rows (embedded, runtime up)"
    )
    ap.add_argument("--buffers", action="store_true", help="only the buffer reads (64 MiB)")
    ap.add_argument("--big", action="store_true", help="buffer reads of 1 GiB too")
    ap.add_argument("--runs", type=int, default=3, help="whole-process runs per system")
    ap.add_argument("--monarch", action="store_true", help=argparse.SUPPRESS)  # the subprocess
    args = ap.parse_args()
    it = {"one": 1000, "all": 300, "tensor": 25, "warmup": 50}
    if args.quick:
        it = {"one": 100, "all": 30, "tensor": 3, "warmup": 10}
    # Only the JSON goes to stdout: whatever else writes there (Ray prints raylet warnings to
    # the driver's stdout) goes to stderr instead.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    if args.monarch:
        print(json.dumps(measure({"monarch": spawn_monarch}, it)["monarch"]), file=out, flush=True)
        return
    loadavg = os.getloadavg()
    if args.sigkill:
        print(json.dumps(sigkill_only(loadavg)), file=out, flush=True)
        return
    sizes = ["64MiB", "1GiB"] if args.big else ["64MiB"]
    if args.buffers:
        print(json.dumps(buffers_only(loadavg, sizes, args.quick)), file=out, flush=True)
        return
    if args.whole:
        whole = whole_process(args.runs)
        report = {"bench": "messaging", "only": "whole_process", "cpus": os.cpu_count()}
        report.update(loadavg_start_end=[loadavg, os.getloadavg()], whole_process_4_s=whole)
        published = MONARCH_WHOLE_PUBLISHED_S
        embedded, ray_start = whole["raymesh"]["median"], whole["ray_start"]["median"]
        report["targets"] = {
            "embedded_within_ray_start_plus_2s": {
                "embedded_s": embedded,
                "ray_start_s": ray_start,
                "met": embedded <= ray_start + 2.0,
            },
            f"runtime_up_within_{MONARCH_LIMITS['whole_process_4_s']}x_monarch": {
                "monarch_s": whole.get("monarch", {}).get("median", published),
                "ratio": (
                    r := ratio(
                        whole["raymesh_runtime_up"]["median"],
                        whole.get("monarch", {}).get("median", published),
                    )
                ),
                "met": r is not None and r <= MONARCH_LIMITS["whole_process_4_s"],
            },
        }
        print(json.dumps(report), file=out, flush=True)
        return
    os.environ.setdefault("RAYMESH_WARM_PROCS", "16")
    whole = whole_process(1 if args.quick else args.runs)
    monarch = run_monarch(args.quick)  # before Ray starts: it never shares the machine's Ray
    monarch_buffers = _buffers.run_monarch(sizes, args.quick)
    from raymesh._src.backend import ensure_ray, shutdown

    t0 = time.perf_counter()
    ensure_ray()
    log(f"ray up in {time.perf_counter() - t0:.1f}s")
    res = measure({"raymesh": spawn_raymesh, "raw_ray": spawn_raw_ray}, it)
    res["raymesh"]["sigkill_to_supervision_error_ms"] = sigkill_to_supervision_error(SIGKILLS)
    settle_pool()
    rm_buffers = _buffers.run_raymesh(sizes, args.quick)
    shutdown()  # the procs and actors are stopped already; this ends the local Ray
    for system, figure in whole.items():
        if system in ("raymesh_runtime_up", "ray_start"):
            res["raymesh"][f"whole_process_4_{system.removeprefix('raymesh_')}_s"] = figure
        else:
            (monarch if system == "monarch" else res["raymesh"])["whole_process_4_s"] = figure
    report = {
        "bench": "messaging",
        "quick": args.quick,
        "iterations": it,
        "cpus": os.cpu_count(),
        "loadavg_start_end": [loadavg, os.getloadavg()],
        "versions": {d: version(d) for d in ("raymesh", "ray", "torch", "torchmonarch")},
        "zero_copy_torch": os.environ.get("RAY_ENABLE_ZERO_COPY_TORCH_TENSORS"),
        **build_report(res, monarch),
        "buffers": {
            "raymesh": rm_buffers,
            "monarch": monarch_buffers,
            "targets": _buffers.targets(rm_buffers, monarch_buffers),
        },
        "anchors_published": ANCHORS_PUBLISHED,
    }
    print(json.dumps(report), file=out, flush=True)


if __name__ == "__main__":
    main()
