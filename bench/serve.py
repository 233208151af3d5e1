"""Serving benchmark: raymesh.serve vs Ray Serve vs a plain uvicorn process, in one run.

    python bench/serve.py                # full: 3 repeats x 2000 requests (~20 min on 2 cores)
    python bench/serve.py --quick        # smoke run: 1 repeat x 200 requests (~3-4 min), no file

The model of ../shared/anchors/ray_serve.py: nn.Sequential(Linear(16, 64), ReLU, Linear(64, 4))
after torch.manual_seed(0), one torch thread, POST JSON {"x": [16 floats]} -> {"y": [4 floats]}.
Servers, all on 127.0.0.1, started once and measured interleaved (per repeat, per client count,
the servers in an order rotated by the repeat):
- raymesh.serve: serve.deploy(model, input_shape=(16,), replicas=1, max_batch_size=32,
  batch_wait_ms=5), POST /v1/predict; its HTTP front runs in this process;
- Ray Serve: the anchor's deployment (one replica, num_cpus=0, access log off, route "/") on
  raymesh's Ray (started by raymesh's ensure_ray() on the main thread before the first
  deploy, its warm procs up, as bench/tune.py does), its proxy on a free port;
- plain uvicorn: the anchor's Starlette app calling the model inline, in a subprocess, path "/";
- raymesh's backend="ray-serve" (Ray Serve with @serve.batch), POST /v1/predict, when it deploys
  next to the anchor's app; else it is measured alone after the anchor's app is shut down (not
  interleaved), or its error is recorded.
Load: a closed loop in a separate python (this script with --load, so it never shares the
front's GIL): N threads, each with its own keep-alive http.client connection (10 s timeout),
a few untimed warm-up requests each, then, all together, requests/N back to back. Latency of
every timed request (p50/p99 over all of them, failed ones included); req/s = timed requests /
wall time of the timed phase; every 200 response is checked against the model's output (1e-5).
Bounded: a deadline per load run (120 s: a slower server sends fewer requests, "hit_deadline"),
a join timeout per thread, a timeout per request. Client counts 1, 16, 64 (1 client: at most
1000 requests); figures: median over the repeats, with the per-repeat ones.

Then two raymesh apps with replicas=2 under a 64-client load that runs until told to stop:
- healing: ~1 s into the load one replica is SIGKILLed; the load stops 1 s after the replica
  set is back to 2 (or 30 s); failed requests (target 0), the new pid set and how long it took;
- reload: an app from checkpoint dir1, ~1 s into the load `app.reload(dir2)`; the load stops
  1 s after it returns; failed requests (target 0), how long the reload took, and whether
  responses afterwards equal dir2's model (and no dir1 response came after reload returned).
Targets (from issue 15): req/s >= 10x Ray Serve's at each client count with p99 no worse, req/s
at 64 clients >= plain uvicorn's, 0 failures during the kill and during the reload. Progress
goes to stderr; one JSON object to stdout, also written to bench/results/serve.json (not with
--quick).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import queue
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import urllib.parse
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SCRIPT = os.path.abspath(__file__)
RESULTS = Path(SCRIPT).parent / "results" / "serve.json"
X = [0.1 * i for i in range(16)]  # the anchor's request
BODY = json.dumps({"x": X}).encode()
HDRS = {"Content-Type": "application/json"}
TOL = 1e-5
RM_PATH, ANCHOR_PATH = "/v1/predict", "/"
BATCH = {"max_batch_size": 32, "batch_wait_ms": 5.0}
TARGET_VS_RAY_SERVE, TARGET_VS_PLAIN = 10.0, 1.0
READY_S, HEAL_S = 120.0, 30.0
CHILD_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}

# The anchor's plain baseline, verbatim: the same model behind Starlette, run by uvicorn.
_PLAIN_APP = r"""
import sys, torch, torch.nn as nn, uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
async def predict(request):
    body = await request.json()
    with torch.no_grad():
        y = model(torch.tensor(body["x"]).unsqueeze(0))
    return JSONResponse({"y": y[0].tolist()})
app = Starlette(routes=[Route("/", predict, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
"""


def log(*a: object) -> None:
    print("[serve-bench]", *a, file=sys.stderr, flush=True)


# -- the load generator (runs in its own python: `serve.py --load SPEC`) -----------------------


def load_main(spec: dict[str, Any]) -> dict[str, Any]:
    """A closed loop of spec["clients"] threads; prints a start line when the timed phase begins
    and returns the result. Stops early on a "stop" line on stdin or after spec["max_s"]."""
    u = urllib.parse.urlsplit(spec["url"])
    host, port, path = u.hostname or "127.0.0.1", u.port or 80, spec["path"]
    n = int(spec["clients"])
    per = max(1, int(spec["requests"]) // n)
    warmup, max_s = int(spec.get("warmup", 5)), float(spec.get("max_s", 120.0))
    refs: dict[str, list[float]] = spec.get("refs", {})
    stop = threading.Event()
    barrier = threading.Barrier(n + 1)
    lock = threading.Lock()
    lat: list[float] = []
    codes: Counter[str] = Counter()
    errors: list[str] = []
    labels: dict[str, dict[str, float]] = {}
    wrong: list[str] = []
    warm_errors = [0]
    hit_deadline = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "stop":
                stop.set()
                return

    def connect() -> http.client.HTTPConnection:
        return http.client.HTTPConnection(host, port, timeout=10)

    def one(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
        conn.request("POST", path, body=BODY, headers=HDRS)
        r = conn.getresponse()
        return r.status, r.read()

    def classify(data: bytes) -> str:
        if not refs:
            return "unchecked"
        try:
            y = json.loads(data)["y"]
        except Exception:
            return "other"
        for name, ref in refs.items():
            if len(y) == len(ref) and all(abs(a - b) <= TOL for a, b in zip(y, ref)):
                return name
        return "other"

    def worker() -> None:
        conn = connect()
        for _ in range(warmup):
            try:
                one(conn)
            except Exception:
                with lock:
                    warm_errors[0] += 1
                conn.close()
                conn = connect()
        try:
            barrier.wait(timeout=60)
        except threading.BrokenBarrierError:
            pass
        deadline = time.perf_counter() + max_s
        my_lat: list[float] = []
        my_codes: Counter[str] = Counter()
        my_err: list[str] = []
        my_labels: dict[str, list[float]] = {}  # label -> [count, first_t, last_t]
        my_wrong: list[str] = []
        for _ in range(per):
            if stop.is_set():
                break
            if time.perf_counter() > deadline:
                hit_deadline.set()
                break
            t = time.perf_counter()
            try:
                status, data = one(conn)
            except Exception as e:
                status, data = 0, repr(e).encode()
                conn.close()
                conn = connect()
            my_lat.append(time.perf_counter() - t)
            if status == 200:
                my_codes["200"] += 1
                label = classify(data)
                now = time.time()
                rec = my_labels.setdefault(label, [0, now, now])
                rec[0] += 1
                rec[2] = now
                if label == "other" and len(my_wrong) < 3:
                    my_wrong.append(data[:200].decode(errors="replace"))
            else:
                my_codes[str(status) if status else "exception"] += 1
                if len(my_err) < 5:
                    my_err.append(f"{status or 'exception'}: {data[:200].decode(errors='replace')}")
        conn.close()
        with lock:
            lat.extend(my_lat)
            codes.update(my_codes)
            errors.extend(my_err)
            wrong.extend(my_wrong)
            for label, (c, first, last) in my_labels.items():
                agg = labels.setdefault(label, {"count": 0, "first_t": first, "last_t": last})
                agg["count"] += c
                agg["first_t"] = min(agg["first_t"], first)
                agg["last_t"] = max(agg["last_t"], last)

    threading.Thread(target=watch_stdin, daemon=True).start()
    threads = [threading.Thread(target=worker, daemon=True) for _ in range(n)]
    for th in threads:
        th.start()
    try:
        barrier.wait(timeout=120)
    except threading.BrokenBarrierError:
        pass
    t0, wall0 = time.perf_counter(), time.time()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"event": "timed_start", "t": wall0}), flush=True)
    end = t0 + max_s + 30
    for th in threads:
        th.join(timeout=max(0.1, end - time.perf_counter()))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    with lock:
        lat_s = sorted(lat)
        failed = sum(v for k, v in codes.items() if k != "200")
        out = {
            "clients": n,
            "requests_asked": per * n,
            "requests_timed": len(lat_s),
            "wall_s": round(wall, 3),
            "rps": round(len(lat_s) / wall, 1) if wall > 0 else None,
            "ok_rps": round(codes["200"] / wall, 1) if wall > 0 else None,
            "p50_ms": round(pct(lat_s, 0.5) * 1e3, 3) if lat_s else None,
            "p99_ms": round(pct(lat_s, 0.99) * 1e3, 3) if lat_s else None,
            "errors": failed,
            "first_errors": errors[:5],
            "codes": dict(codes),
            "warmup_errors": warm_errors[0],
            "responses": labels,
            "wrong_responses": labels.get("other", {}).get("count", 0),
            "first_wrong": wrong[:3],
            "stopped_early": stop.is_set(),  # told to stop (stdin)
            "hit_deadline": hit_deadline.is_set(),  # ran out of max_s before `requests`
            "stuck_threads": sum(th.is_alive() for th in threads),
            "client_cpu_share": round(cpu / wall, 2) if wall > 0 else None,
            "t_start": wall0,
            "t_end": time.time(),
        }
    return out


def pct(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[int(q * (len(sorted_xs) - 1))]


class Load:
    """One load generator subprocess (`serve.py --load`)."""

    def __init__(self, url: str, path: str, clients: int, requests: int, **spec: Any) -> None:
        spec = {"url": url, "path": path, "clients": clients, "requests": requests, **spec}
        self.max_s = float(spec.get("max_s", 120.0))
        self.proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--load", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **CHILD_ENV),
            start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def started(self, timeout: float = 120.0) -> float:
        """Wait for the timed phase to begin; its wall-clock start."""
        line = self.lines.get(timeout=timeout)
        if line is None:
            raise RuntimeError(f"load generator exited early (rc {self.proc.wait()})")
        return float(json.loads(line)["t"])

    def stop(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("stop\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def result(self) -> dict[str, Any]:
        try:
            self.proc.wait(timeout=self.max_s + 90)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError("load generator ran past its deadline") from None
        last = None
        while (line := self.lines.get(timeout=10)) is not None:
            if line.strip():
                last = line
        if self.proc.returncode != 0 or last is None:
            raise RuntimeError(f"load generator failed (rc {self.proc.returncode})")
        out = json.loads(last)
        if "event" in out:
            raise RuntimeError("load generator printed no result")
        return out

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


def run_load(url: str, path: str, clients: int, requests: int, **spec: Any) -> dict[str, Any]:
    load = Load(url, path, clients, requests, **spec)
    try:
        load.started()
        return load.result()
    finally:
        if load.proc.poll() is None:
            load.kill()


# -- servers -----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, path: str, timeout: float = 10.0) -> list[float]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    try:
        conn.request("POST", path, body=BODY, headers=HDRS)
        r = conn.getresponse()
        data = r.read()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {data[:200]!r}")
        return json.loads(data)["y"]
    finally:
        conn.close()


def wait_ready(url: str, path: str, timeout: float = READY_S) -> float:
    """Seconds until `url + path` answers 200; TimeoutError after `timeout`."""
    t0 = time.time()
    last: Exception | None = None
    while time.time() - t0 < timeout:
        try:
            post(url, path, timeout=5)
            return round(time.time() - t0, 2)
        except Exception as e:
            last = e
            time.sleep(0.2)
    raise TimeoutError(f"{url}{path} not answering after {timeout:.0f} s (last: {last!r})")


def close(y: list[float], ref: list[float]) -> bool:
    return len(y) == len(ref) and all(abs(a - b) <= TOL for a, b in zip(y, ref))


def make_model(seed: int = 0) -> torch.nn.Module:
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)
    ).eval()


def output(model: torch.nn.Module) -> list[float]:
    import torch

    with torch.no_grad():
        return model(torch.tensor(X).unsqueeze(0))[0].tolist()


def anchor_app() -> Any:
    """The anchor's Ray Serve deployment, unchanged."""
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
    class TinyModel:
        def __init__(self):
            import torch
            import torch.nn as nn

            torch.set_num_threads(1)
            torch.manual_seed(0)
            self.torch = torch
            self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).eval()

        def predict(self, x):
            with self.torch.no_grad():
                y = self.model(self.torch.tensor(x).unsqueeze(0))
            return {"y": y[0].tolist()}

        async def __call__(self, request: Request):
            body = await request.json()
            return self.predict(body["x"])

    return TinyModel.bind()


class Cleanup:
    """Named teardown steps, run once each: early by name, the rest at the end (newest first)."""

    def __init__(self) -> None:
        self.steps: dict[str, Callable[[], object]] = {}

    def add(self, name: str, fn: Callable[[], object]) -> None:
        self.steps[name] = fn

    def run(self, name: str) -> None:
        fn = self.steps.pop(name, None)
        if fn is None:
            return
        try:
            fn()
        except Exception as e:
            log(f"cleanup {name}: {e!r}")

    def all(self) -> None:
        for name in reversed(list(self.steps)):
            self.run(name)


def stop_process_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    except ProcessLookupError:
        pass


def bounded(fn: Callable[[], Any], timeout: float) -> Any:
    """fn() on a daemon thread; its result, its exception, or TimeoutError after `timeout`."""
    done: queue.Queue[tuple[bool, Any]] = queue.Queue()

    def call() -> None:
        try:
            done.put((True, fn()))
        except BaseException as e:
            done.put((False, e))

    threading.Thread(target=call, daemon=True).start()
    try:
        ok, value = done.get(timeout=timeout)
    except queue.Empty:
        raise TimeoutError(f"no answer within {timeout:.0f} s") from None
    if not ok:
        raise value
    return value


def error_text(e: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return re.sub(r"\x1b\[[0-9;]*m", "", text)[-1500:]  # without terminal colours


# -- the comparison ----------------------------------------------------------------------------


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    xs = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(xs), 3) if xs else None


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keep = ("rps", "p50_ms", "p99_ms", "errors", "wrong_responses", "warmup_errors")
    keep += ("requests_timed", "hit_deadline", "client_cpu_share", "error")
    return {
        "rps": median_of(runs, "rps"),
        "p50_ms": median_of(runs, "p50_ms"),
        "p99_ms": median_of(runs, "p99_ms"),
        "errors": sum(r.get("errors", 0) for r in runs),
        "wrong_responses": sum(r.get("wrong_responses", 0) for r in runs),
        "first_errors": next((r["first_errors"] for r in runs if r.get("first_errors")), []),
        "per_repeat": [{k: r[k] for k in keep if k in r} for r in runs],
    }


def measure_all(
    servers: dict[str, tuple[str, str]],
    clients: list[int],
    args: argparse.Namespace,
    ref: list[float],
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {str(c): [] for c in clients} for name in servers
    }
    names = list(servers)
    for rep in range(args.repeats):
        order = names[rep % len(names) :] + names[: rep % len(names)]
        for c in clients:
            requests = min(args.requests, 1000) if c == 1 else args.requests
            for name in order:
                url, path = servers[name]
                try:
                    r = run_load(url, path, c, requests, refs={"model": ref}, max_s=120.0)
                except Exception as e:
                    r = {"error": error_text(e), "errors": requests}
                runs[name][str(c)].append(r)
                log(
                    f"rep {rep} clients {c:>2} {name:<16} {r.get('rps')} req/s "
                    f"p50 {r.get('p50_ms')} ms p99 {r.get('p99_ms')} ms "
                    f"errors {r.get('errors')} wrong {r.get('wrong_responses')} "
                    f"warm-up errors {r.get('warmup_errors')} "
                    f"client cpu {r.get('client_cpu_share')}"
                )
    return runs


def comparison(res: dict[str, Any], args: argparse.Namespace, clean: Cleanup) -> None:
    import ray

    from raymesh import serve as rm_serve

    clients = [int(c) for c in args.clients.split(",")]
    model = make_model(0)
    ref = output(model)
    servers: dict[str, tuple[str, str]] = {}
    ready: dict[str, float] = {}
    setup: dict[str, Any] = {}
    res["comparison"] = {"setup": setup}

    from raymesh._src import backend
    from raymesh._src.backend import pool

    # Ray on this (the main) thread first. Ray's head processes (gcs_server, raylet) die with
    # the thread that started them (PR_SET_PDEATHSIG): left to serve.deploy, Ray is started on
    # a thread of the app's router, and the first app.stop() SIGKILLs the whole Ray head.
    t0 = time.time()
    backend.ensure_ray()
    setup["warm_procs_ready"] = pool.wait_ready(60.0)
    setup["ray_start_s"] = round(time.time() - t0, 2)
    t0 = time.time()
    app = rm_serve.deploy(model, input_shape=(16,), replicas=1, port=0, **BATCH)
    clean.add("raymesh_app", app.stop)
    servers["raymesh"] = (app.url, RM_PATH)
    ready["raymesh"] = wait_ready(app.url, RM_PATH)
    setup["raymesh_deploy_to_ready_s"] = round(time.time() - t0, 2)
    setup["raymesh_replica_pids"] = app.replica_pids()

    setup["same_ray_as_raymesh"] = ray.is_initialized()  # Ray Serve joins raymesh's Ray
    from ray import serve as ray_serve

    t0 = time.time()
    port = free_port()
    ray_serve.start(http_options={"host": "127.0.0.1", "port": port})
    clean.add("ray_serve", ray_serve.shutdown)
    ray_serve.run(
        anchor_app(), name="tiny", route_prefix="/", logging_config={"enable_access_log": False}
    )
    servers["ray_serve"] = (f"http://127.0.0.1:{port}", ANCHOR_PATH)
    ready["ray_serve"] = wait_ready(*servers["ray_serve"])
    setup["ray_serve_start_to_ready_s"] = round(time.time() - t0, 2)

    plain_port = free_port()
    plain = subprocess.Popen(
        [sys.executable, "-c", _PLAIN_APP, str(plain_port)],
        env=dict(os.environ, **CHILD_ENV),
        start_new_session=True,
    )
    clean.add("plain", lambda: stop_process_group(plain))
    servers["plain_uvicorn"] = (f"http://127.0.0.1:{plain_port}", ANCHOR_PATH)
    ready["plain_uvicorn"] = wait_ready(*servers["plain_uvicorn"])

    # raymesh's Ray Serve backend, next to the anchor's app on the same Serve instance.
    fourth: dict[str, Any] = {"interleaved": True}
    res["comparison"]["raymesh_ray_serve_backend_setup"] = fourth
    try:
        app4 = bounded(
            lambda: rm_serve.deploy(
                model, input_shape=(16,), replicas=1, port=0, backend="ray-serve", **BATCH
            ),
            90.0,
        )
        clean.add("raymesh_ray_serve_app", app4.stop)
        ready["raymesh_ray_serve"] = wait_ready(app4.url, RM_PATH, timeout=60)
        servers["raymesh_ray_serve"] = (app4.url, RM_PATH)
    except Exception as e:
        fourth.update(interleaved=False, error_next_to_anchor=error_text(e))
        log(f"raymesh backend='ray-serve' next to the anchor's app: {e!r}")
        clean.run("raymesh_ray_serve_app")
    # The anchor's app must be unharmed by that attempt.
    ready["ray_serve_recheck"] = wait_ready(*servers["ray_serve"], timeout=30)
    setup["ready_s"] = ready

    for name, (url, path) in servers.items():  # untimed warm-up, also checks the answers
        try:
            r = run_load(url, path, 16, 320, refs={"model": ref}, max_s=60.0)
            setup.setdefault("warmup", {})[name] = {k: r[k] for k in ("rps", "errors")}
            y = post(url, path)
            setup.setdefault("answer_matches_model", {})[name] = close(y, ref)
        except Exception as e:
            setup.setdefault("warmup", {})[name] = {"error": error_text(e)}

    runs = measure_all(servers, clients, args, ref)
    rows = {name: {c: summarise(rs) for c, rs in per_c.items()} for name, per_c in runs.items()}
    res["comparison"]["rows"] = rows
    try:
        res["comparison"]["raymesh_stats"] = app.stats()
    except Exception as e:
        res["comparison"]["raymesh_stats"] = {"error": error_text(e)}

    clean.run("raymesh_ray_serve_app")
    clean.run("plain")
    clean.run("raymesh_app")
    clean.run("ray_serve")

    if "raymesh_ray_serve" not in servers:  # alone, on a Serve instance of its own
        try:
            app4 = bounded(
                lambda: rm_serve.deploy(
                    model, input_shape=(16,), replicas=1, port=0, backend="ray-serve", **BATCH
                ),
                READY_S,
            )
            clean.add("raymesh_ray_serve_app", app4.stop)
            fourth["ready_alone_s"] = wait_ready(app4.url, RM_PATH, timeout=60)
            fourth["measured"] = "alone, after the anchor's Serve app was shut down"
            alone = measure_all({"raymesh_ray_serve": (app4.url, RM_PATH)}, clients, args, ref)
            rows["raymesh_ray_serve"] = {
                c: summarise(rs) for c, rs in alone["raymesh_ray_serve"].items()
            }
        except Exception as e:
            fourth["error_alone"] = error_text(e)
            log(f"raymesh backend='ray-serve' alone: {e!r}")
        finally:
            clean.run("raymesh_ray_serve_app")


# -- healing and reload under load -------------------------------------------------------------


def wait_replicas(app: Any, n: int, timeout: float) -> list[int]:
    t_end = time.time() + timeout
    while time.time() < t_end:
        pids = app.replica_pids()
        if len(pids) >= n:
            return pids
        time.sleep(0.2)
    raise TimeoutError(f"{n} replicas not ready after {timeout:.0f} s: {app.replica_pids()}")


def retried(app: Any) -> int | None:
    try:
        return app.stats().get("retried")
    except Exception:
        return None


def healing(res: dict[str, Any], args: argparse.Namespace, clean: Cleanup) -> None:
    from raymesh import serve as rm_serve

    model = make_model(0)
    ref = output(model)
    out: dict[str, Any] = {}
    res["healing"] = out
    app = rm_serve.deploy(model, input_shape=(16,), replicas=2, port=0, **BATCH)
    clean.add("heal_app", app.stop)
    wait_ready(app.url, RM_PATH)
    before = sorted(wait_replicas(app, 2, 60.0))
    retried0 = retried(app)
    out["replica_pids_before"] = before
    load = Load(app.url, RM_PATH, 64, 64 * 5000, refs={"model": ref}, max_s=90.0)
    try:
        t_start = load.started()
        time.sleep(1.0)
        victim = before[0]
        t_kill = time.time()
        os.kill(victim, signal.SIGKILL)
        out["killed_pid"] = victim
        out["kill_at_s_into_load"] = round(t_kill - t_start, 2)
        healed_s, pids = None, before
        while time.time() - t_kill < HEAL_S:
            pids = sorted(app.replica_pids())
            if len(pids) >= 2 and victim not in pids:
                healed_s = round(time.time() - t_kill, 2)
                break
            time.sleep(0.1)
        out["replica_pids_after"] = pids
        out["back_to_2_replicas"] = healed_s is not None
        out["back_to_2_replicas_s"] = healed_s
        time.sleep(1.0)  # load on the healed set
        load.stop()
        r = load.result()
    finally:
        if load.proc.poll() is None:
            load.kill()
    out["load"] = {k: v for k, v in r.items() if k not in ("t_start", "t_end")}
    out["failed_requests"] = r["errors"] + r["stuck_threads"]
    out["kill_during_load"] = t_start < t_kill < r["t_end"]
    r0, r1 = retried0, retried(app)
    out["retried"] = r1 - r0 if isinstance(r0, int) and isinstance(r1, int) else r1
    log(f"healing: {out}")
    clean.run("heal_app")


def checkpoint(folder: str, model: torch.nn.Module) -> None:
    import torch

    from raymesh.train.checkpoint import Checkpointer

    Checkpointer(folder, keep=2).save(
        1,
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        world_size=1,
        strategy="ddp",
        config={},
        data_position=0,
        rank=0,
    )


def reload(res: dict[str, Any], args: argparse.Namespace, clean: Cleanup, tmp: str) -> None:
    from raymesh import serve as rm_serve

    out: dict[str, Any] = {}
    res["reload"] = out
    m1, m2 = make_model(1), make_model(2)
    refs = {"dir1": output(m1), "dir2": output(m2), "seed0": output(make_model(0))}
    dir1, dir2 = os.path.join(tmp, "dir1"), os.path.join(tmp, "dir2")
    checkpoint(dir1, m1)
    checkpoint(dir2, m2)
    app = rm_serve.deploy(make_model(0), checkpoint=dir1, input_shape=(16,), replicas=2, port=0,
                          **BATCH)  # fmt: skip
    clean.add("reload_app", app.stop)
    wait_ready(app.url, RM_PATH)
    wait_replicas(app, 2, 60.0)
    out["before_matches_dir1"] = all(close(post(app.url, RM_PATH), refs["dir1"]) for _ in range(8))
    load = Load(app.url, RM_PATH, 64, 64 * 5000, refs=refs, max_s=120.0)
    try:
        t_start = load.started()
        time.sleep(1.0)
        t0 = time.time()
        try:
            app.reload(dir2)
        except Exception as e:
            out["reload_error"] = error_text(e)
        t1 = time.time()
        out["reload_s"] = round(t1 - t0, 2)
        out["reload_at_s_into_load"] = round(t0 - t_start, 2)
        time.sleep(1.0)  # load after the reload
        load.stop()
        r = load.result()
    finally:
        if load.proc.poll() is None:
            load.kill()
    out["load"] = {k: v for k, v in r.items() if k not in ("t_start", "t_end")}
    out["failed_requests"] = r["errors"] + r["stuck_threads"]
    out["reload_during_load"] = t_start < t0 and t1 < r["t_end"]
    after = [post(app.url, RM_PATH) for _ in range(20)]
    out["after_matches_dir2"] = all(close(y, refs["dir2"]) for y in after)
    last_dir1 = r["responses"].get("dir1", {}).get("last_t")
    out["last_dir1_response_after_reload_returned_s"] = (
        round(last_dir1 - t1, 3) if last_dir1 is not None else None
    )
    out["responses_by_model"] = {k: v["count"] for k, v in r["responses"].items()}
    out["replica_pids_after"] = app.replica_pids()
    log(f"reload: {out}")
    clean.run("reload_app")


# -- targets and the report --------------------------------------------------------------------


def targets(res: dict[str, Any]) -> dict[str, Any]:
    rows = res.get("comparison", {}).get("rows", {})
    rm, rs, plain = (
        rows.get("raymesh", {}),
        rows.get("ray_serve", {}),
        rows.get("plain_uvicorn", {}),
    )
    out: dict[str, Any] = {}
    for c in rm:
        a, b = rm[c], rs.get(c, {})
        ratio = a["rps"] / b["rps"] if a.get("rps") and b.get("rps") else None
        p99_ok = (
            a["p99_ms"] <= b["p99_ms"]
            if a.get("p99_ms") is not None and b.get("p99_ms") is not None
            else None
        )
        out[f"vs_ray_serve_{c}_clients"] = {
            "rps_ratio": round(ratio, 2) if ratio is not None else None,
            "rps_ratio_min": TARGET_VS_RAY_SERVE,
            "raymesh_p99_ms": a.get("p99_ms"),
            "ray_serve_p99_ms": b.get("p99_ms"),
            "met": bool(ratio is not None and ratio >= TARGET_VS_RAY_SERVE and p99_ok),
        }
    a, b = rm.get("64", {}), plain.get("64", {})
    ratio = a["rps"] / b["rps"] if a.get("rps") and b.get("rps") else None
    out["vs_plain_uvicorn_64_clients"] = {
        "rps_ratio": round(ratio, 3) if ratio is not None else None,
        "rps_ratio_min": TARGET_VS_PLAIN,
        "met": bool(ratio is not None and ratio >= TARGET_VS_PLAIN),
    }
    heal, rel = res.get("healing", {}), res.get("reload", {})
    out["kill_failed_requests"] = {
        "failed": heal.get("failed_requests"),
        "met": heal.get("failed_requests") == 0 and bool(heal.get("kill_during_load")),
    }
    out["reload_failed_requests"] = {
        "failed": rel.get("failed_requests"),
        "met": rel.get("failed_requests") == 0
        and bool(rel.get("reload_during_load"))
        and "reload_error" not in rel,
    }
    out["met"] = sorted(k for k, v in out.items() if v["met"])
    out["not_met"] = sorted(k for k, v in out.items() if isinstance(v, dict) and not v["met"])
    out["all_met"] = not out["not_met"]
    return out


def versions() -> dict[str, Any]:
    from importlib import metadata

    out: dict[str, Any] = {"python": platform.python_version(), "cpus": os.cpu_count()}
    for dist in ("raymesh", "ray", "torch", "starlette", "uvicorn"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 repeat x 200 requests, no file")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", default="1,16,64")
    p.add_argument("--load", help=argparse.SUPPRESS)  # internal: one load generator run
    args = p.parse_args()
    if args.load:
        print(json.dumps(load_main(json.loads(args.load))), flush=True)
        return
    if args.quick:
        args.repeats, args.requests = 1, 200

    # Exactly one JSON object on stdout: everything else (Ray's forwarded worker output too)
    # goes to stderr.
    stdout = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    os.environ.update(CHILD_ENV)
    import torch

    torch.set_num_threads(1)
    res: dict[str, Any] = {
        "bench": "serve",
        "mode": "quick" if args.quick else "full",
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "versions": versions(),
        "job": "nn.Sequential(Linear(16,64), ReLU, Linear(64,4)), seed 0, 1 torch thread, "
        'POST {"x": [16 floats]} on 127.0.0.1; closed-loop load in a separate python',
        "repeats": args.repeats,
        "requests": args.requests,
        "clients": [int(c) for c in args.clients.split(",")],
        "raymesh_config": {"replicas": 1, **BATCH},
        "errors": {},
    }
    clean = Cleanup()
    t0 = time.time()
    try:
        with tempfile.TemporaryDirectory(prefix="bench_serve_", ignore_cleanup_errors=True) as tmp:
            phases: list[tuple[str, Callable[[], None]]] = [
                ("comparison", lambda: comparison(res, args, clean)),
                ("healing", lambda: healing(res, args, clean)),
                ("reload", lambda: reload(res, args, clean, tmp)),
            ]
            for name, fn in phases:
                try:
                    fn()
                except Exception as e:
                    res["errors"][name] = traceback.format_exc()[-3000:]
                    log(f"{name} failed: {e!r}")
                finally:
                    clean.all()
    finally:
        clean.all()
    res["targets"] = targets(res)
    res["wall_s"] = round(time.time() - t0, 1)
    res["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(res, default=str)
    if not args.quick:
        RESULTS.parent.mkdir(exist_ok=True)
        RESULTS.write_text(text + "\n")
    stdout.write(text + "\n")
    stdout.flush()


if __name__ == "__main__":
    main()
