"""Where a proc's output and log records go: `ProcMesh.logging_option` (Monarch's), applied in
each proc by a short-lived actor so that it takes the proc's own message path.

- `level`: the proc's root logger level, with a stderr handler added once (a Ray worker's root
  logger has none, so `logger.info` in an actor would otherwise print nothing).
- `stream_to_client=False`: the proc's stdout and stderr (file descriptors 1 and 2, so C
  extensions' output too) go to a file of its own, `$TMPDIR/raymesh-logs-<uid>/<mesh>-<pid>.log`,
  instead of the worker log that Ray forwards to the controller; True puts them back.

And, in every process that hosts actors, log records name the actor that made them
(`name_actors_in_records`).
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from raymesh._src.actor import Actor
from raymesh._src.backend.switches import switch
from raymesh._src.context import context, current_actor_context

__all__ = ["LoggingOption", "log_path", "name_actors_in_records"]

_installed = threading.Lock()
_named = False


def name_actors_in_records() -> None:
    """From now on, a log record made while an actor handles a message (in this process) names
    it, as Monarch's do: its message starts with `[actor=<module.Class name{rank}>] ` and
    `record.actor_prefix` holds that text, whatever handler or formatter prints it. An empty
    message is left empty (torch's structured trace logging relies on that). Records made
    outside any actor are untouched. Idempotent; `RAYMESH_LOG_ACTOR_PREFIX=0` turns it off."""
    global _named
    if not switch(
        "RAYMESH_LOG_ACTOR_PREFIX",
        True,
        on="log records made in an actor are prefixed with its name",
        off="they are left as made",
    ):
        return
    with _installed:
        if _named:
            return
        _named = True
        make = logging.getLogRecordFactory()

        def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            rec = make(*args, **kwargs)
            ctx = current_actor_context()
            if ctx is not None:
                prefix = f"[actor={ctx.actor_instance!r}] "
                rec.actor_prefix = prefix
                if isinstance(rec.msg, str) and rec.msg:
                    # %-escaped: getMessage() formats msg % args.
                    rec.msg = prefix.replace("%", "%%") + rec.msg if rec.args else prefix + rec.msg
            return rec

        logging.setLogRecordFactory(record)


_saved: dict[int, int] = {}  # fd -> a duplicate of what it was before it went to the file


def log_path(mesh_name: str, pid: int) -> Path:
    """The file a proc's output goes to while it is not streamed to the controller."""
    return Path(tempfile.gettempdir()) / f"raymesh-logs-{os.getuid()}" / f"{mesh_name}-{pid}.log"


class _Handler(logging.StreamHandler):
    """The stderr handler `level` adds to a proc's root logger (once)."""


def _apply(mesh_name: str, stream_to_client: bool, level: int) -> None:
    root = logging.getLogger()
    root.setLevel(level)
    if not any(isinstance(h, _Handler) for h in root.handlers):
        handler = _Handler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    sys.stdout.flush()
    sys.stderr.flush()
    if not stream_to_client and not _saved:
        path = log_path(mesh_name, os.getpid())
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        for fd in (1, 2):
            _saved[fd] = os.dup(fd)
            os.dup2(target, fd)
        os.close(target)
    elif stream_to_client:
        for fd, original in list(_saved.items()):
            os.dup2(original, fd)
            os.close(original)
            del _saved[fd]


class LoggingOption(Actor):
    """Applies the options in its constructor, on the proc it is spawned on."""

    def __init__(self, stream_to_client: bool, level: int) -> None:
        _apply(context().proc_mesh_name, stream_to_client, level)
