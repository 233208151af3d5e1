"""The dashboard's web app: Starlette routes over `Runs`, live updates as server-sent events.

    GET /                      the runs page: every run, studies' trials, loss curves compared
    GET /run/<id>              a job's page: states, curves per rank, failures and healing,
                               strategy and placement, live while the job runs
    GET /mesh/<id>             the job's procs on their hosts, and its supervision events
    GET /api/runs              {"root", "runs": [summary], "studies": [...], "problems": [...]}
    GET /api/run/<id>          {"summary", "rows", "events", "warnings"}; 404 {"error"}
    GET /api/stream/<id>?rows=N&events=M
                               text/event-stream: `rows`, `events`, `warning` and `summary`
                               messages with what is new past the first N rows and M events,
                               then `end` once the run has ended
    GET /metrics               Prometheus: each run's step, loss, samples/s, failures, ranks
    GET /static/...            the pages' script and style, and uPlot (vendored, MIT)

With a token, every /api request and /metrics carries it as `Authorization: Bearer <token>`;
the pages themselves (/, /run/..., /mesh/..., /static) hold no run data and load without it.
The page gets the token from a form it shows when the API answers 401, or from the URL's
fragment (`#token=...`, which browsers never send to a server, so no server, proxy or log sees
it), keeps it in the tab's sessionStorage and takes it out of the address bar. A token in a
query string (`?token=`) is not accepted: URLs end up in histories, proxies' logs and Referer
headers. A refusal is raymesh's error shape, `{"error": {"type", "message"}}` (the token's
check is the shared `BearerAuth`). docs/dashboard.md describes the files read and every field.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from raymesh._common import BearerAuth, HTTPError, check_token
from raymesh.dashboard.runs import Runs

__all__ = ["make_app"]

STATIC = Path(__file__).parent / "static"
_POLL_S = 0.5  # how often a live stream looks for new lines
_HEARTBEAT_S = 15.0  # a comment line this often keeps proxies from closing an idle stream
# The token, as a 401 names it: a browser's page asks for it; other clients send the header.
_WHAT = "this dashboard's token (the page asks for it)"


def make_app(root: str | Path, *, token: str | None = None) -> Starlette:
    """The dashboard over the run folders under `root` (or `root`, itself a run folder).
    ValueError naming `token` when it cannot be one (shorter than 16 characters, not
    printable ASCII): checked here, as Starlette builds its middleware only at the first
    request."""
    if token is not None:
        check_token("token", token)
    runs = Runs(root)

    def page(name: str) -> Any:
        # Not guarded: a page is the same static file for every run, holding no run data; it
        # must load without the token to ask for it.
        async def handler(request: Request) -> Response:
            return FileResponse(STATIC / name, headers={"Cache-Control": "no-cache"})

        return handler

    def missing(id: str) -> JSONResponse:
        return _error(404, f"no run folder {id!r} under {runs.root}: it may have been removed")

    async def api_runs(request: Request) -> Response:
        return JSONResponse(runs.listing())

    async def api_run(request: Request) -> Response:
        id = request.path_params["id"]
        run = runs.get(id)
        if run is None:
            return missing(id)
        return JSONResponse(
            {
                "summary": run.summary(),
                "rows": run.rows,
                "events": run.events,
                "warnings": run.warnings,
            }
        )

    async def api_stream(request: Request) -> Response:
        id = request.path_params["id"]
        run = runs.get(id)
        if run is None:
            return missing(id)
        try:
            rows = int(request.query_params.get("rows", 0))
            events = int(request.query_params.get("events", 0))
        except ValueError:
            return _error(400, "rows and events must be whole numbers")
        return StreamingResponse(
            _stream(request, runs, id, rows, events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def metrics(request: Request) -> Response:
        return Response(_prometheus(runs), media_type="text/plain; version=0.0.4")

    app = Starlette(
        routes=[
            Route("/", page("runs.html")),
            Route("/run/{id:path}", page("job.html")),
            Route("/mesh/{id:path}", page("mesh.html")),
            Route("/api/runs", api_runs),
            Route("/api/run/{id:path}", api_run),
            Route("/api/stream/{id:path}", api_stream),
            Route("/metrics", metrics),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        # The pages and /static hold no run data and load without the token (to ask for it).
        middleware=[Middleware(BearerAuth, token, paths=("/api/", "/metrics"), what=_WHAT)],
    )
    # Set (from any thread) before the server stops: live streams end at their next poll,
    # instead of holding the server's graceful shutdown until it gives up on them.
    app.state.stopping = threading.Event()
    return app


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(HTTPError(status, None, message).payload(), status_code=status)


def _sse(name: str, data: Any) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def _stream(
    request: Request, runs: Runs, id: str, rows: int, events: int
) -> AsyncIterator[str]:
    """What is new in run `id` past the first `rows` rows and `events` events, as it is
    appended, until the run ends or the client goes. A row is sent once per step: a step
    trained again (the same values, as the data order depends on the step only) is not sent
    twice."""
    run = runs.get(id)
    if run is None:
        return
    sent_step = run.rows[min(rows, len(run.rows)) - 1]["step"] if rows > 0 and run.rows else 0
    warned = len(run.warnings)
    quiet = 0.0
    while True:
        new_rows = [r for r in run.rows if r["step"] > sent_step]
        new_events = run.events[events:]
        changed = bool(new_rows or new_events)
        if new_rows:
            sent_step = new_rows[-1]["step"]
            yield _sse("rows", new_rows)
        if new_events:
            events = len(run.events)
            yield _sse("events", new_events)
        for warning in run.warnings[warned:]:
            yield _sse("warning", warning)
        warned = len(run.warnings)
        if changed:
            yield _sse("summary", run.summary())
            quiet = 0.0
        if run.status() != "running":
            yield _sse("end", run.summary())
            return
        if await request.is_disconnected() or request.app.state.stopping.is_set():
            return
        await asyncio.sleep(_POLL_S)
        quiet += _POLL_S
        if quiet >= _HEARTBEAT_S:
            quiet = 0.0
            yield ": heartbeat\n\n"
        if runs.get(id) is None:  # the folder was removed while the page watched it
            yield _sse("warning", f"the run folder {run.path} is gone")
            yield _sse("end", run.summary())
            return


_GAUGES = (
    ("raymesh_run_step", "The run's newest step", "step"),
    ("raymesh_run_loss", "The run's newest loss (mean of ranks)", "loss"),
    ("raymesh_run_samples_per_second", "Samples per second, newest chunk", "samples_per_s"),
    ("raymesh_run_failures", "Failures so far", "failures"),
    ("raymesh_run_world_size", "Ranks training now", "world_size"),
    ("raymesh_run_spares", "Warm spares ready", "spares"),
)


def _prometheus(runs: Runs) -> bytes:
    """Every run's figures as Prometheus gauges labelled by run, and whether it runs."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import GaugeMetricFamily

    summaries = runs.listing()["runs"]

    class Collector:
        def collect(self) -> Any:
            for name, help, key in _GAUGES:
                family = GaugeMetricFamily(name, help, labels=["run"])
                for s in summaries:
                    if isinstance(s.get(key), int | float):
                        family.add_metric([s["id"]], float(s[key]))
                yield family
            running = GaugeMetricFamily("raymesh_run_running", "1 while it runs", labels=["run"])
            for s in summaries:
                running.add_metric([s["id"]], float(s["status"] == "running"))
            yield running

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry)
