"""What several subsystems share, in one place below them all: field checks and `Range`,
job-file tables, "module:function" names, the HTTP server thread with its TLS, bearer-token
middleware and error shape, a future adapter, a folder written whole or not at all, and lines
appended whole.

It sits just above the core (it may import the core, and nothing above it), so that
raymesh.train, .tune, .serve, .federated, .data, .dashboard and the CLI can all use it. Private:
users meet these through the subsystems (`serve.Tls`, `ServeConfig`'s checks, job files).
"""

from raymesh._common.auth import MIN_TOKEN_CHARS, BearerAuth, BearerToken, check_token
from raymesh._common.fields import bad, brief, check_int, check_seconds, is_int
from raymesh._common.folders import append_lines, new_folder, replace_text
from raymesh._common.functions import resolve
from raymesh._common.futures import Pending
from raymesh._common.http_error import HTTPError, RefusalLog, error_json, printable
from raymesh._common.ranges import Range
from raymesh._common.server import ServerThread, exposure, free_port, is_loopback, url_of
from raymesh._common.tables import (
    TABLES,
    from_table,
    read_toml,
    section_of,
    split_job,
    store_sections,
    stored,
)
from raymesh._common.tls import Tls

__all__ = [
    "MIN_TOKEN_CHARS",
    "TABLES",
    "BearerAuth",
    "BearerToken",
    "HTTPError",
    "Pending",
    "Range",
    "RefusalLog",
    "ServerThread",
    "Tls",
    "append_lines",
    "bad",
    "brief",
    "check_int",
    "check_seconds",
    "check_token",
    "error_json",
    "exposure",
    "free_port",
    "from_table",
    "is_int",
    "is_loopback",
    "new_folder",
    "printable",
    "read_toml",
    "replace_text",
    "resolve",
    "section_of",
    "split_job",
    "store_sections",
    "stored",
    "url_of",
]
