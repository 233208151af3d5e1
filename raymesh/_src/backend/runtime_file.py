"""The local runtime's file: how a program finds the runtime `raymesh up` started.

`raymesh up` (see `local_runtime`) writes `runtime.json` into a per-user directory
(`RAYMESH_RUNTIME_DIR`, else `$XDG_RUNTIME_DIR/raymesh`, else `/tmp/raymesh-<uid>`), mode 0700
as Ray's own session directory is: its Ray address, its daemon's pid, and what it runs (raymesh
and Ray versions, and a fingerprint of raymesh's code). A program with no address of its own
attaches only to a runtime that is alive and runs what it runs; anything else is said in one
line with its fix, and the program starts the embedded Ray as it would with no runtime.

The file is JSON, written atomically by the daemon and read with bounds: nothing in it is
ever unpickled or run, and a directory that another user could write to is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raymesh._src.backend.switches import switch
from raymesh._version import __version__

MAX_FILE_BYTES = 64 * 1024
# The daemon's module: a pid is the runtime's only while its command line names it.
DAEMON_MODULE = "raymesh._src.backend.local_runtime"
NAMESPACE = "raymesh-runtime"  # the Ray namespace of the runtime's named actors
logger = logging.getLogger("raymesh")


_TYPES: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str}


class RuntimeDirError(RuntimeError):
    """The runtime directory cannot be trusted (another owner, or writable by others)."""


class RuntimeLostError(RuntimeError):
    """The local runtime this program attached to is gone (stopped or killed) while the
    program waited on it: its procs, its Ray and its object store went with it. Raised by every
    wait of the program from then on; the program cannot go on, and ends as it chooses."""


@dataclass(frozen=True, kw_only=True)
class RuntimeRecord:
    """What `runtime.json` says of a runtime."""

    address: str  # the Ray head's GCS address, host:port on loopback
    pid: int  # the daemon's; its Ray processes are its children
    started: float  # time.time() when it was up
    raymesh: str
    ray: str
    code: str  # `code_fingerprint()` of the raymesh it runs
    cpus: int
    warm: int  # warm procs it keeps
    log: str  # the daemon's log file

    @classmethod
    def from_json(cls, data: Any) -> RuntimeRecord:
        fields = cls.__dataclass_fields__
        if not isinstance(data, dict) or set(data) != set(fields):
            what = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a runtime record: {what}")
        record = cls(**data)
        for name, f in fields.items():
            want = _TYPES[str(f.type)]
            value = getattr(record, name)
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"runtime record field {name}={value!r} is not a {f.type}")
        return record


def runtime_dir(create: bool = False) -> Path:
    """The per-user runtime directory (see the module docstring). Raises RuntimeDirError when
    it exists but belongs to another user or is open to others: a file there could point this
    user's programs at anyone's Ray."""
    given = os.environ.get("RAYMESH_RUNTIME_DIR")
    if given:
        path = Path(given)
    elif os.environ.get("XDG_RUNTIME_DIR"):
        path = Path(os.environ["XDG_RUNTIME_DIR"]) / "raymesh"
    else:
        path = Path(tempfile.gettempdir()) / f"raymesh-{os.getuid()}"
    if create:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        st = path.stat()
    except FileNotFoundError:
        return path
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RuntimeDirError(
            f"raymesh's runtime directory {path} is not this user's alone (owner uid "
            f"{st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); fix: remove it, or set "
            "RAYMESH_RUNTIME_DIR to a directory of your own with mode 0700"
        )
    return path


def file_path() -> Path:
    return runtime_dir() / "runtime.json"


def read() -> RuntimeRecord | None:
    """The record, or None when there is none. ValueError when the file is not a record."""
    path = file_path()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(raw) > MAX_FILE_BYTES:
        raise ValueError(f"{path} is over {MAX_FILE_BYTES} bytes: not a runtime record")
    try:
        return RuntimeRecord.from_json(json.loads(raw))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a runtime record ({e})") from None


def write(record: RuntimeRecord) -> Path:
    """Write the record atomically (a reader sees the old file or the new one, whole)."""
    path = runtime_dir(create=True) / "runtime.json"
    tmp = path.with_name(f".runtime.json.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(asdict(record), f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def remove_if(record: RuntimeRecord) -> bool:
    """Remove the file if it still holds `record` (not a newer runtime's); whether it did."""
    try:
        if read() != record:
            return False
    except ValueError:
        pass  # not a record at all: nothing of anyone's to keep
    try:
        file_path().unlink()
    except FileNotFoundError:
        return False
    return True


def alive(record: RuntimeRecord) -> bool:
    """Whether the record's daemon runs: its pid is a process whose command line names the
    daemon's module (a pid reused by another process is not the runtime)."""
    try:
        with open(f"/proc/{record.pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        try:
            os.kill(record.pid, 0)  # no /proc (macOS): the pid alone
        except ProcessLookupError:
            return False
        except PermissionError:
            return False  # another user's process: not ours
        return True
    return DAEMON_MODULE.encode() in argv


def answers(record: RuntimeRecord, timeout: float = 2.0) -> bool:
    """Whether the runtime's head accepts a connection within `timeout` (ray.init would
    otherwise retry a dead address for minutes)."""
    host, _, port = record.address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def code_fingerprint() -> str:
    """raymesh's version, Ray's, and the newest modification time of raymesh's own modules:
    warm procs import raymesh when they start, so a runtime started before raymesh's code
    changed (an editable install being worked on) would run the old code."""
    import ray

    package = Path(__file__).resolve().parents[2]  # raymesh/
    newest = max((p.stat().st_mtime_ns for p in package.rglob("*.py")), default=0)
    text = f"{__version__}|{ray.__version__}|{newest}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def mismatch(record: RuntimeRecord) -> str | None:
    """Why this program cannot use `record`'s runtime, or None when it can."""
    import ray

    if record.ray != ray.__version__:
        return f"it runs Ray {record.ray}, this program Ray {ray.__version__}"
    if record.raymesh != __version__:
        return f"it runs raymesh {record.raymesh}, this program raymesh {__version__}"
    if record.code != code_fingerprint():
        return "raymesh's code changed since it started (its warm procs hold the old code)"
    return None


def current() -> RuntimeRecord | None:
    """The record of the runtime that is up, if any: a stale file (its daemon gone) is
    removed, saying so. ValueError / RuntimeDirError as `read` and `runtime_dir`."""
    record = read()
    if record is None or alive(record):
        return record
    remove_if(record)
    logger.warning(
        "raymesh: the local runtime of %s (pid %d) is gone; its stale file is removed "
        "(`raymesh up` starts a runtime again)",
        record.address,
        record.pid,
    )
    return None


def find() -> RuntimeRecord | None:
    """The local runtime to attach to, if one is up and runs what this program runs; anything
    else about it is said in one line, with its fix (the caller then starts the embedded Ray)."""
    if not switch(
        "RAYMESH_RUNTIME",
        True,
        on="programs attach to a local runtime that `raymesh up` started",
        off="each program starts its own Ray",
    ):
        return None
    try:
        record = current()
    except (ValueError, RuntimeDirError) as e:
        logger.warning("raymesh: %s; starting the embedded Ray", e)
        return None
    if record is None:
        return None
    if not answers(record):
        logger.warning(
            "raymesh: the local runtime's head at %s does not answer (its daemon, pid %d, "
            "lives); starting the embedded Ray (fix: `raymesh down && raymesh up`)",
            record.address,
            record.pid,
        )
        return None
    why = mismatch(record)
    if why is not None:
        logger.warning(
            "raymesh: not attaching to the local runtime at %s: %s; starting the embedded Ray "
            "(fix: `raymesh down && raymesh up`)",
            record.address,
            why,
        )
        return None
    return record


def uptime(started: float) -> str:
    seconds = max(0, int(time.time() - started))
    return (
        f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
        if seconds >= 3600
        else (f"{seconds // 60}m{seconds % 60:02d}s")
    )
