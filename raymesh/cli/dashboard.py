"""`raymesh dashboard`: the web page of the run folders under a folder, live and afterwards.

    raymesh dashboard runs/                    every run under runs/, at http://127.0.0.1:8266
    raymesh dashboard runs/ --port 0           any free port (the URL is printed)
    raymesh dashboard runs/ --host 0.0.0.0 --token SECRET
                                               reachable from other machines, with a token

`raymesh train job.toml --dashboard` serves the same page for the job it runs (`serve_for`).
It reads files only: no Ray is started.
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

from raymesh.dashboard import DEFAULT_PORT

__all__ = ["DEFAULT_PORT", "add_parser", "run", "serve_for"]


def add_parser(sub: Any) -> None:
    """Register the `dashboard` subcommand on `raymesh`'s subparsers."""
    p = sub.add_parser("dashboard", help="a web page of the training runs under a folder")
    p.add_argument("root", help="a folder of run folders (e.g. runs/), or one run folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument("--token", help="require this token on every request (the URL carries it)")


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Serve until Ctrl-C (or until `stop` is set)."""
    from raymesh import dashboard

    root = Path(args.root)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        print(
            f"raymesh dashboard: {root} {what}: give the folder that holds your run folders "
            "(a job's run_dir or checkpoint dir, or its parent, e.g. runs/)",
            file=sys.stderr,
        )
        return 2
    try:
        board = dashboard.start(root, host=args.host, port=args.port, token=args.token)
    except (OSError, ValueError) as e:
        print(f"raymesh dashboard: {e} (choose another --port, or 0 for any)", file=sys.stderr)
        return 2
    print(f"raymesh dashboard: {board.url}  (runs under {root.resolve()}; Ctrl-C to stop)")
    sys.stdout.flush()
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        board.stop()
    return 0


def serve_for(run_dir: Path, port: int) -> Any:
    """The dashboard of `run_dir`'s parent for `raymesh train --dashboard` (the runs beside
    it show too); prints the job's page. Falls back to any free port when `port` is taken."""
    from raymesh import dashboard

    try:
        board = dashboard.start(run_dir.parent, port=port)
    except OSError:
        board = dashboard.start(run_dir.parent, port=0)
    print(f"dashboard: {board.run_url(run_dir.name)}")
    sys.stdout.flush()
    return board
