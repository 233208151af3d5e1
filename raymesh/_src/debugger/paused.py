"""The paused actors of this host: one small JSON file per paused actor, in this user's runtime
directory (`<runtime dir>/debug/`, the directory `raymesh up` keeps its `runtime.json` in).

Where the token lives, and why: each file holds the actor's public description (mesh, rank,
host, file, line: what `list` prints) and the token its pdb socket asks for. The directory is
this user's alone (0700, refused when open to others, as `runtime_file` checks) and each file
is 0600, so only this user's processes can read a token: only the controller's user can
attach. The token never goes into a `PausedActor` (what `list()` returns and prints), a log
line or a command line. A Ray named actor holding the entries was the alternative; it would
need a Ray connection (seconds) in `raymesh debug`, and any client of the cluster could read it.

The files are per host, as the loopback sockets they point at: `raymesh debug` lists, and
attaches to, the actors paused on the host it runs on. A file whose process is gone (a
SIGKILLed proc) is removed by the next reader.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raymesh._src.backend.runtime_file import runtime_dir

__all__ = ["PausedActor", "check", "entries", "remove", "write"]

_MAX_FILE_BYTES = 16 * 1024


@dataclass(frozen=True, kw_only=True)
class PausedActor:
    """One actor paused in pdb, as `raymesh.debug.list()` gives it (no secret in it)."""

    mesh: str  # the actor mesh's name (`spawn("name", Cls)`): what attach and cast take
    actor_class: str  # module.Class of the actor
    rank: int  # its rank in its actor mesh
    coords: dict[str, int]  # its point: axis -> coordinate
    extent: dict[str, int]  # its actor mesh's axes: axis -> size
    mesh_id: str  # the actor mesh's unique id (two meshes may share a name)
    proc: str  # its proc's id
    host: str  # the host it runs on (its socket listens on that host's loopback)
    pid: int  # its proc's process id
    job: str  # the Ray job (program) it belongs to
    port: int  # its pdb socket, on 127.0.0.1
    file: str  # where pdb stopped
    line: int
    function: str
    reason: str  # "breakpoint", or "post-mortem: <exception>"
    since: float  # time.time() when it paused

    @property
    def size(self) -> int:
        """How many ranks its actor mesh has."""
        n = 1
        for v in self.extent.values():
            n *= v
        return n

    @property
    def name(self) -> str:
        """`mesh[rank]`, as messages name it."""
        return f"{self.mesh}[{self.rank}]"


def _dir(create: bool) -> Path:
    path = runtime_dir(create=create) / "debug"
    if create:
        path.mkdir(mode=0o700, exist_ok=True)
    return path


def check() -> None:
    """Make sure the directory can take files (RuntimeDirError, naming the fix, when it is open
    to other users), before an actor pauses."""
    _dir(create=True)


def write(actor: PausedActor, token: str) -> Path:
    """Write (or rewrite, as pdb moves) the actor's file atomically, readable by this user
    only. Returns its path."""
    path = _dir(create=True) / f"{actor.pid}-{actor.port}.json"
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"actor": asdict(actor), "token": token}, f)
    os.replace(tmp, path)
    return path


def remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def entries() -> list[tuple[PausedActor, str, Path]]:
    """Every paused actor of this user on this host: (actor, token, its file), ordered by mesh
    and rank. Files of processes that are gone are removed; unreadable ones are skipped."""
    try:
        folder = _dir(create=False)
        files = sorted(folder.glob("*.json"))
    except OSError:
        return []
    out = []
    for path in files:
        found = _read(path)
        if found is None:
            continue
        actor, token = found
        if actor.host == socket.gethostname() and not _alive(actor.pid):
            remove(path)
            continue
        out.append((actor, token, path))
    out.sort(key=lambda e: (e[0].mesh, e[0].rank, e[0].since))
    return out


def _read(path: Path) -> tuple[PausedActor, str] | None:
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_FILE_BYTES + 1)
        if len(raw) > _MAX_FILE_BYTES:
            return None
        data: Any = json.loads(raw)
        actor = PausedActor(**data["actor"])
        token = data["token"]
    except (OSError, ValueError, TypeError, KeyError):
        return None  # written by something else, or half-gone: not an entry
    if not isinstance(token, str) or not isinstance(actor.port, int):
        return None
    return actor, token


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's: not one of ours
    return True
