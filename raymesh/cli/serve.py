"""`raymesh serve job.toml`: serve a trained checkpoint over HTTP until Ctrl-C (or SIGTERM);
`raymesh serve reload --checkpoint NEW`: roll a running server to another checkpoint."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from typing import Any

from raymesh.cli.args import count_or_range

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a trained checkpoint over HTTP (or: serve reload --checkpoint NEW)",
        description="Serve the model of a job file over HTTP: `raymesh serve job.toml`. "
        "Roll a running server to a new checkpoint: `raymesh serve reload --checkpoint NEW`.",
    )
    p.add_argument("job", help="the TOML job file that trained the model, or `reload`")
    p.add_argument("--checkpoint", help="checkpoint folder (default: the job's [checkpoint] dir)")
    p.add_argument("--replicas", type=count_or_range, help="N, or MIN:MAX to autoscale")
    p.add_argument("--host", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, help="port (default 8000; 0: any free port)")
    p.add_argument(
        "--token", help="require this bearer token (default: $RAYMESH_SERVE_TOKEN if set)"
    )
    p.add_argument("--max-batch-size", type=int, dest="max_batch_size")
    p.add_argument("--batch-wait-ms", type=float, dest="batch_wait_ms")
    p.add_argument("--backend", choices=["raymesh", "ray-serve"])
    p.add_argument(
        "--url", default="http://127.0.0.1:8000", help="reload: the server (default %(default)s)"
    )


def run(args: argparse.Namespace) -> int:
    if args.job == "reload":
        return _reload(args)
    import logging

    from raymesh import serve
    from raymesh.serve.jobfile import load_serving

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    overrides = {
        k: getattr(args, k)
        for k in (
            "checkpoint",
            "replicas",
            "host",
            "port",
            "token",
            "max_batch_size",
            "batch_wait_ms",
            "backend",
        )
    }
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        model, config = load_serving(args.job, **overrides)
        app = serve.deploy(config=config, **model)
    except ValueError as e:  # a user mistake: one clear line, no traceback
        print(f"raymesh serve: {e}", file=sys.stderr)
        return 2
    checkpoint = model.get("checkpoint")
    print(
        f"serving {app.url} ({config.replicas} replica(s); checkpoint {checkpoint}); "
        "Ctrl-C to stop",
        flush=True,
    )
    try:
        stop.wait()
    finally:
        app.stop()
    print("stopped", flush=True)
    return 0


def _reload(args: argparse.Namespace) -> int:
    if not args.checkpoint:
        print("raymesh serve reload: give --checkpoint NEW", file=sys.stderr)
        return 2
    token = args.token or os.environ.get("RAYMESH_SERVE_TOKEN")
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        args.url.rstrip("/") + "/admin/reload",
        data=json.dumps({"checkpoint": os.path.abspath(args.checkpoint)}).encode(),
        headers=headers,
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")[:500]
        print(f"raymesh serve reload: HTTP {e.code}: {detail}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError) as e:
        print(f"raymesh serve reload: cannot reach {args.url}: {e}", file=sys.stderr)
        return 1
    print(f"reloaded: {body['replicas']} replica(s) serve {body['checkpoint']}")
    return 0
