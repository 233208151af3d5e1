"""Probe actors: one small actor per node that reads its node's facts and times the network.

`probe(node_ids, facts, timeout=...)` runs `facts()` on every node (in this process for the
caller's own node, in that node's probe actor for the others), times each node's own object
store (put + get: the "loopback" figure), and, when there are several nodes, times every pair:
latency as half the median round trip of an empty actor call, bandwidth as a `payload_bytes`
object pulled from one node's object store into the other's process.

Guarantees: returns within about `timeout` seconds whatever the cluster does (what did not
finish by then is reported in `errors`, never waited for); a complete report is cached for `ttl`
seconds per (nodes, facts, payload size); a cluster of one node (the caller's) needs no actor.
The figures are Ray's (actor calls, object transfer), so they include Ray's own overhead: an
upper bound on the network's latency and a lower bound on its bandwidth, good for ranking links.

Probe actors take no CPU (they run even on a full cluster), are pinned to their node
(NodeAffinitySchedulingStrategy, soft=False) and live as long as the process that made them.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import ray

from raymesh._src.backend import runtime

_LATE = "did not finish in time"
_PINGS = 5  # timed round trips per pair (after one warm-up)
_TRANSFERS = 2  # timed payload pulls per pair; the fastest counts
_probes: dict[str, Any] = {}
_probes_lock = threading.Lock()
_cache: dict[tuple, tuple[float, ProbeReport]] = {}
_cache_lock = threading.Lock()


@dataclass(frozen=True, kw_only=True)
class ProbeReport:
    """What the probes saw. Figures are (one-way latency s, bandwidth bytes/s)."""

    facts: dict[str, Any]  # node id -> facts() as returned on that node
    loopback: dict[str, tuple[float, float]]  # node id -> its own object store's figures
    links: dict[tuple[str, str], tuple[float, float]]  # (a, b) with a before b in node_ids
    errors: tuple[str, ...] = ()  # what did not finish in time, or failed
    measured_at: float = 0.0  # unix time
    elapsed_s: float = 0.0
    cached: bool = False  # True: served from the cache, not measured by this call
    payload_bytes: int = 0  # size of the object timed between nodes


def loopback(nbytes: int) -> tuple[float, float]:
    """This process's object store, put then get: (latency of a tiny object, bandwidth of
    `nbytes`). A few milliseconds, except a process's first use of its object store, which
    can take seconds (hence `probe` runs it on a thread)."""
    lat = []
    for _ in range(3):
        t = time.perf_counter()
        ray.get(ray.put(b""))
        lat.append(time.perf_counter() - t)
    blob = bytes(nbytes)
    t = time.perf_counter()
    ray.get(ray.put(blob))
    took = time.perf_counter() - t
    return statistics.median(lat), nbytes / max(took, 1e-9)


class _Probe:
    """Pinned to one node: reads its facts, answers pings, serves payloads, times a peer."""

    def facts(self, fn: Callable[[], Any], nbytes: int) -> tuple[Any, tuple[float, float]]:
        return fn(), loopback(nbytes)

    def ping(self) -> None:
        return None

    def payload(self, nbytes: int) -> list[Any]:
        # A fresh object each time, owned here, so that the caller's get is a real transfer;
        # wrapped in a list so that Ray hands back the reference, not the bytes.
        return [ray.put(bytes(nbytes))]

    def measure(self, peer: Any, nbytes: int, seconds: float) -> tuple[float, float] | None:
        """(one-way latency, bandwidth) from this node to `peer`'s, or None when that took
        more than `seconds` (a wedged peer does not hold this actor's thread). None, not an
        error: the caller has stopped waiting by then, and Ray prints an error nobody reads."""
        try:
            return self._measure(peer, nbytes, time.monotonic() + seconds)
        except ray.exceptions.GetTimeoutError:
            return None

    def _measure(self, peer: Any, nbytes: int, deadline: float) -> tuple[float, float]:

        def get(ref: Any) -> Any:
            return ray.get(ref, timeout=max(deadline - time.monotonic(), 0.001))

        get(peer.ping.remote())  # warm-up: the first call sets up the connection
        rtts = []
        for _ in range(_PINGS):
            t = time.perf_counter()
            get(peer.ping.remote())
            rtts.append(time.perf_counter() - t)
        best = 0.0
        for _ in range(_TRANSFERS):
            [ref] = get(peer.payload.remote(nbytes))
            t = time.perf_counter()
            get(ref)
            best = max(best, nbytes / max(time.perf_counter() - t, 1e-9))
            del ref
        return statistics.median(rtts) / 2, best


# No CPU, so that probes run even on a cluster whose CPUs are all reserved.
Probe: Any = ray.remote(num_cpus=0, max_concurrency=4)(_Probe)  # type: ignore[call-overload]


def _probe_actor(node_id: str) -> Any:
    return runtime.node_actor(Probe, "raymesh-probe", node_id, _probes, _probes_lock)


def stop_probes() -> None:
    """End every probe actor this process made (they otherwise end with the process)."""
    with _probes_lock:
        actors = list(_probes.values())
        _probes.clear()
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:
            pass


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()


class _Background:
    """A call on a daemon thread whose result is waited for until a deadline, no longer."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self._fn = fn
        self._box: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._run, name="raymesh-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._box["value"] = self._fn()
        except Exception as e:
            self._box["error"] = e

    def result(self, deadline: float) -> Any:
        self._thread.join(max(deadline - time.monotonic(), 0.0))
        if self._thread.is_alive():
            raise TimeoutError(_LATE)
        if "error" in self._box:
            err = self._box["error"]
            raise RuntimeError(f"{type(err).__name__}: {err}")
        return self._box["value"]


def _rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of range(n) once, in rounds where no index appears twice (the circle
    method), so that a node serves one measurement at a time and pairs do not share links."""
    idx: list[int | None] = list(range(n)) + ([None] if n % 2 else [])
    m = len(idx)
    out = []
    for _ in range(m - 1):
        pairs = []
        for k in range(m // 2):
            a, b = idx[k], idx[m - 1 - k]
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        out.append(pairs)
        idx = [idx[0], idx[-1], *idx[1:-1]]
    return out


def _collect(refs: dict[Any, Any], deadline: float) -> tuple[dict[Any, Any], dict[Any, str]]:
    """Results of `refs` ready by `deadline`; the rest (and failures) as error strings."""
    done: dict[Any, Any] = {}
    failed: dict[Any, str] = {}
    if not refs:
        return done, failed
    keys = {ref: k for k, ref in refs.items()}
    ready, pending = ray.wait(
        list(keys), num_returns=len(keys), timeout=max(deadline - time.monotonic(), 0.0)
    )
    for ref in ready:
        try:
            done[keys[ref]] = ray.get(ref)
        except Exception as e:  # the actor died, or facts() raised
            failed[keys[ref]] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for ref in pending:
        failed[keys[ref]] = _LATE
    return done, failed


def probe(
    node_ids: Sequence[str],
    facts: Callable[[], Any],
    *,
    timeout: float = 15.0,
    ttl: float = 60.0,
    payload_bytes: int = 4 << 20,
) -> ProbeReport:
    """Facts and network figures of `node_ids` (see the module docstring for the guarantees).

    facts: a module-level function (Ray ships it by reference), run once per node; its result
    must be picklable. timeout: seconds for the whole probe, actor start-up included.
    ttl: seconds a complete report is reused (0: always measure).
    """
    if not timeout > 0:
        raise ValueError(f"probe: timeout={timeout!r} must be > 0 seconds")
    runtime.ensure_ray()
    node_ids = list(node_ids)
    key = (tuple(node_ids), f"{facts.__module__}.{facts.__qualname__}", payload_bytes)
    now = time.monotonic()
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None and now - hit[0] < ttl:
        return replace(hit[1], cached=True)
    start, deadline = now, now + timeout
    here = runtime.current_node_id()
    errors: list[str] = []
    fact_of: dict[str, Any] = {}
    loop_of: dict[str, tuple[float, float]] = {}
    # Our own node needs no actor; its reads run on a thread so that a slow first object-store
    # use (seconds, once per process) cannot outlast the timeout.
    local = _Background(lambda: (facts(), loopback(payload_bytes))) if here in node_ids else None
    others = [n for n in node_ids if n != here]
    actors = {n: _probe_actor(n) for n in node_ids} if len(node_ids) > 1 else {}
    done, failed = _collect(
        {n: actors[n].facts.remote(facts, payload_bytes) for n in others}, deadline
    )
    if local is not None:
        try:
            done[here] = local.result(deadline)
        except Exception as e:
            failed[here] = str(e)
    for n, (f, lb) in done.items():
        fact_of[n], loop_of[n] = f, lb
    for n, why in failed.items():
        errors.append(f"node {n[:12]}: facts: {why}")
        if why != _LATE:  # a failed probe is not reused; a late one is (it may just be starting)
            with _probes_lock:
                _probes.pop(n, None)
    links: dict[tuple[str, str], tuple[float, float]] = {}
    alive = [n for n in node_ids if n in fact_of]
    for round_ in _rounds(len(alive)):
        if time.monotonic() >= deadline:
            errors.append("network: out of time before every pair was measured")
            break
        pairs = [(alive[a], alive[b]) for a, b in round_]
        done, failed = _collect(
            {
                (a, b): actors[a].measure.remote(
                    actors[b], payload_bytes, max(deadline - time.monotonic(), 0.001)
                )
                for a, b in pairs
            },
            deadline,
        )
        links.update((pair, fig) for pair, fig in done.items() if fig is not None)
        failed.update((pair, _LATE) for pair, fig in done.items() if fig is None)
        errors.extend(f"link {a[:12]}-{b[:12]}: {why}" for (a, b), why in failed.items())
    report = ProbeReport(
        facts=fact_of,
        loopback=loop_of,
        links=links,
        errors=tuple(errors),
        measured_at=time.time(),
        elapsed_s=time.monotonic() - start,
        payload_bytes=payload_bytes,
    )
    if not errors and ttl > 0:
        with _cache_lock:
            _cache[key] = (start, report)
    return report
