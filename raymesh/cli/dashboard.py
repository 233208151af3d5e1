"""`raymesh dashboard`: the web page of the run folders under a folder, live and afterwards.

    raymesh dashboard runs/                    every run under runs/, at http://127.0.0.1:8266
    raymesh dashboard runs/ --port 0           any free port (the URL is printed)
    RAYMESH_DASHBOARD_TOKEN=SECRET raymesh dashboard runs/ --host 0.0.0.0 \\
        --tls-cert cert.pem --tls-key key.pem  reachable from other machines: HTTPS, a token

The token is never printed: the page asks for it (or takes it from `URL#token=SECRET`, a
fragment browsers never send). `--token SECRET` works too, but a command line is visible to
every user of the machine (`ps`); the environment is not.

`raymesh train job.toml --dashboard` serves the same page for the job it runs (`serve_for`).
It reads files only: no Ray is started.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from pathlib import Path
from typing import Any

from raymesh.cli import errors
from raymesh.cli.args import add_tls_arguments
from raymesh.dashboard import DEFAULT_PORT

__all__ = ["DEFAULT_PORT", "TOKEN_ENV", "add_parser", "run", "serve_for"]

TOKEN_ENV = "RAYMESH_DASHBOARD_TOKEN"  # the token, where no --token is given


def add_parser(sub: Any) -> None:
    """Register the `dashboard` subcommand on `raymesh`'s subparsers."""
    p = sub.add_parser("dashboard", help="a web page of the training runs under a folder")
    p.add_argument("root", help="a folder of run folders (e.g. runs/), or one run folder")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}")
    p.add_argument(
        "--token",
        help=f"require this token on every API request (default: ${TOKEN_ENV}, which other "
        "users cannot see, unlike a command line; the page asks for it; it is never printed)",
    )
    add_tls_arguments(p)


def run(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    """Serve until Ctrl-C (or until `stop` is set)."""
    return errors.run("dashboard", lambda: _serve(args, stop))


def _serve(args: argparse.Namespace, stop: threading.Event | None) -> int:
    from raymesh import dashboard

    root = Path(args.root)
    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise ValueError(
            f"{root} {what}: give the folder that holds your run folders "
            "(a job's run_dir or checkpoint dir, or its parent, e.g. runs/)"
        )
    token_from = "--token" if args.token else f"${TOKEN_ENV}"
    token = args.token or os.environ.get(TOKEN_ENV) or None
    tls = dashboard.Tls.of(getattr(args, "tls_cert", None), getattr(args, "tls_key", None))
    try:
        board = dashboard.start(root, host=args.host, port=args.port, token=token, tls=tls)
    except OSError as e:
        hint = f"{e} (choose another --port, or 0 for any)"
        return errors.say("dashboard", hint, errors.USAGE)
    said = f"raymesh dashboard: {board.url}  (runs under {root.resolve()}; Ctrl-C to stop)"
    if token is not None:
        # Never the token itself: a terminal's scrollback, a CI log or a screen share keeps it.
        said += (
            f"\nraymesh dashboard: the page asks for the token given in {token_from} (or open "
            "the URL with #token=<token> after it: browsers never send what follows '#')"
        )
    print(said)  # in one write: a reader never sees the first line without the second
    sys.stdout.flush()
    try:
        (stop or threading.Event()).wait()
    except KeyboardInterrupt:
        pass
    finally:
        board.stop()
    return 0


def serve_for(run_dir: Path, port: int, tls: Any = None) -> Any:
    """The dashboard of `run_dir`'s parent for `raymesh train --dashboard` (the runs beside
    it show too); prints the job's page. Falls back to any free port when `port` is taken.
    On 127.0.0.1, without a token (only this machine reaches it); `tls`: serve HTTPS."""
    from raymesh import dashboard

    try:
        board = dashboard.start(run_dir.parent, port=port, tls=tls)
    except OSError:
        board = dashboard.start(run_dir.parent, port=0, tls=tls)
    print(f"dashboard: {board.run_url(run_dir.name)}")
    sys.stdout.flush()
    return board
