"""raymesh.dashboard: a web page of training runs, live and afterwards.

    raymesh train job.toml --dashboard          # the job's page, live; prints its URL
    raymesh dashboard runs/                     # every run folder under runs/

    from raymesh import dashboard
    with dashboard.start("runs") as board:      # a thread of this process
        print(board.url)

It reads run folders only (`metrics.jsonl`, `events.jsonl`, a study's `results.csv`), so the
same page shows a job while it runs, after it ended, and from another process than the job's.
It binds 127.0.0.1 unless told otherwise; with `token`, every API request must carry it (the
page asks for it once per tab; URLs never hold it); with `tls`, it serves HTTPS.
Needs the `dashboard` extra (Starlette, uvicorn, prometheus_client).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import quote

from raymesh._common import ServerThread, Tls, is_int

__all__ = ["DEFAULT_PORT", "Dashboard", "Tls", "start"]

DEFAULT_PORT = 8266  # beside Ray's dashboard (8265)


class Dashboard:
    """A dashboard served on a thread of this process (`start`); `stop()` ends it."""

    def __init__(self, server: ServerThread, app: Any, token: str | None) -> None:
        self._server = server
        self._app = app
        self.token = token

    @property
    def url(self) -> str:
        """The runs page. Never with the token: a page asks for it (see `login_url`)."""
        return self.page("/")

    def page(self, path: str) -> str:
        """The URL of `path` on this dashboard (without the token)."""
        return f"{self._server.url}{path}"

    def login_url(self, path: str = "/") -> str:
        """`page(path)` with the token in its fragment (`#token=...`): opened in a browser, the
        page takes the token from there into the tab and out of the address bar, and the
        browser never sends a fragment to a server. It holds the secret: hand it to a browser,
        not to a log or a terminal. The plain URL when there is no token."""
        fragment = f"#token={quote(self.token, safe='')}" if self.token else ""
        return self.page(path) + fragment

    def run_url(self, run_id: str) -> str:
        """The page of run `run_id` (its folder relative to the root)."""
        return self.page("/run/" + quote(run_id))

    def stop(self) -> None:
        """Stop serving: open pages' live streams end first (within half a second)."""
        self._app.state.stopping.set()
        self._server.stop(timeout=10.0)

    def __enter__(self) -> Dashboard:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<raymesh.dashboard {self._server.url}>"


def start(
    root: str | Path,
    *,
    host: str = "127.0.0.1",
    port: int = DEFAULT_PORT,
    token: str | None = None,
    tls: Tls | None = None,
) -> Dashboard:
    """Serve the dashboard of the run folders under `root` on a thread of this process.

    root: a folder of run folders (e.g. "runs"), or one run folder. It may not exist yet (a
        job about to start); the page says so until it does.
    port: 0 for any free port. OSError when the port is taken.
    token: when set, every API request must carry it (`Authorization: Bearer`); the page asks
        for it, or takes it from `Dashboard.login_url`'s fragment. Give one whenever the page
        is reachable from other machines, and `tls` with it there, or the token crosses the
        network in the clear (bound beyond loopback without either, it logs a warning).
        ValueError naming `token` (never its value) when it cannot be one: under 16
        characters, or not printable ASCII.
    tls: serve HTTPS with this certificate and key (`Tls(cert=..., key=...)`).
    """
    try:
        from raymesh.dashboard.app import make_app
    except ImportError as e:
        raise ImportError(
            f'the dashboard needs Starlette and uvicorn ({e}): pip install "raymesh[dashboard]"'
        ) from None
    if not is_int(port) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r}: give a TCP port, 0 to 65535 (0: any free port)")
    if tls is not None and not isinstance(tls, Tls):
        raise TypeError(
            f"tls={tls!r}: give raymesh.dashboard.Tls(cert=..., key=...) (PEM files), or None"
        )
    app = make_app(root, token=token)  # ValueError naming `token` when it cannot be one
    server = ServerThread(
        app,
        host=host,
        port=port,
        name="raymesh-dashboard",
        tls=tls,
        authenticated=token is not None,  # the app checks it, by whatever name it is reached
        exposure_fix="set token= and tls=; raymesh dashboard: $RAYMESH_DASHBOARD_TOKEN, "
        "--tls-cert and --tls-key",
    )
    return Dashboard(server, app, token)
