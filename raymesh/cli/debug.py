"""`raymesh debug`: the actors paused in pdb on this host (Monarch's `monarch debug`).

    raymesh debug                          an interactive prompt (raymesh_dbg>) over the commands
    raymesh debug list                     the paused actors: mesh, rank, coords, host, where
    raymesh debug attach MESH RANK         one actor's pdb, here (`detach` leaves it paused)
    raymesh debug cast MESH 'ranks(0:4)' CMD...
                                           one pdb command to many ranks; each rank's output
    raymesh debug continue                 clear breakpoints and resume every paused actor

`--job JOB` keeps to one program's actors (when two programs paused meshes of the same name).
Nothing here connects to Ray: the paused actors are found in this user's runtime directory.
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable
from typing import Any

from raymesh import debug
from raymesh.cli import errors

__all__ = ["add_parser", "repl", "run"]

HELP = """raymesh_dbg commands:
  list (l)                           the paused actors
  attach (a) MESH RANK               attach to one; in pdb, `detach` comes back here
  cast MESH ranks(...) COMMAND       send a pdb command to many ranks: ranks(1), ranks(1,4,6),
                                     ranks(start:stop:step), ranks(hosts=0, gpus=1:3)
  continue (c)                       clear breakpoints and resume every paused actor
  help (h)                           this text
  quit (q)                           leave; paused actors stay paused
"""
_CAST = re.compile(r"cast\s+(\S+)\s+(ranks\(.*?\))\s+(.+)$")


def add_parser(sub: Any) -> None:
    p = sub.add_parser("debug", help="list, attach to and command actors paused in pdb")
    p.add_argument("--job", help="only the actors of this Ray job (program)")
    actions = p.add_subparsers(dest="debug_command")
    actions.add_parser("list", help="the paused actors")
    a = actions.add_parser("attach", help="attach to one paused actor's pdb")
    a.add_argument("mesh", help="the actor mesh's name (or its class's)")
    a.add_argument("rank", type=int)
    c = actions.add_parser("cast", help="send one pdb command to many ranks")
    c.add_argument("mesh")
    c.add_argument("ranks", help="ranks(0:4), ranks(1,3), 0:4, ...")
    c.add_argument("pdb_command", nargs=argparse.REMAINDER, help="the pdb command")
    actions.add_parser("continue", help="clear breakpoints and resume every paused actor")


def run(args: argparse.Namespace) -> int:
    return errors.run("debug", lambda: _run(args), mistakes=(ValueError, debug.DebugError))


def _run(args: argparse.Namespace) -> int:
    job = args.job
    what = args.debug_command
    if what is None:
        return repl(job)
    if what == "list":
        print(table(debug.list_paused(job)))
    elif what == "attach":
        debug.attach(args.mesh, args.rank, job=job).interact()
    elif what == "cast":
        if not args.pdb_command:
            raise ValueError("cast: give the pdb command after the ranks (e.g. `p x`)")
        print(_outputs(debug.cast(args.mesh, args.ranks, " ".join(args.pdb_command), job=job)))
    else:
        print(_resumed(debug.continue_all(job=job)))
    return 0


def repl(
    job: str | None = None,
    read: Callable[[str], str] = input,
    write: Callable[[str], object] = print,
) -> int:
    """The interactive prompt: one command a line until `quit` or end of input. A command
    that fails says why and the prompt goes on."""
    write("raymesh debugger: `help` for the commands, `list` for the paused actors")
    while True:
        try:
            line = read("raymesh_dbg> ").strip()
        except (EOFError, KeyboardInterrupt):
            write("")
            return 0
        if not line:
            continue
        if line in ("q", "quit"):
            return 0
        try:
            out = _command(line, job, read)
        except (ValueError, debug.DebugError, TimeoutError) as e:
            out = f"error: {e}"
        if out:
            write(out)


def _command(line: str, job: str | None, read: Callable[[str], str]) -> str:
    word, _, rest = line.partition(" ")
    if word in ("h", "help"):
        return HELP
    if word in ("l", "list"):
        return table(debug.list_paused(job))
    if word in ("c", "continue"):
        return _resumed(debug.continue_all(job=job))
    if word in ("a", "attach"):
        parts = shlex.split(rest)
        if len(parts) != 2 or not parts[1].isdigit():
            raise ValueError(f"attach {rest!r}: write `attach MESH RANK`, e.g. `attach trainer 0`")
        session = debug.attach(parts[0], int(parts[1]), job=job)
        session.interact(read=lambda: read(""))
        return ""
    if word == "cast":
        m = _CAST.match(line)
        if m is None:
            raise ValueError(
                f"{line!r}: write `cast MESH ranks(...) COMMAND`, e.g. "
                "`cast trainer ranks(0:2) p loss`"
            )
        return _outputs(debug.cast(m.group(1), m.group(2), m.group(3), job=job))
    raise ValueError(f"unknown command {word!r}; `help` lists the commands")


def table(actors: list[debug.PausedActor]) -> str:
    """The paused actors, one a line (Monarch's columns, plus why and the program)."""
    if not actors:
        return "no actor is paused on this host"
    rows = [("mesh", "rank", "coords", "host", "function", "file:line", "paused by", "job")]
    for a in actors:
        coords = ",".join(f"{k}={v}" for k, v in a.coords.items())
        rows.append(
            (a.mesh, str(a.rank), coords, a.host, a.function, f"{a.file}:{a.line}", a.reason, a.job)
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _outputs(results: dict[int, str]) -> str:
    return "\n".join(
        f"--- rank {rank} ---\n{out.rstrip()}" if out.strip() else f"--- rank {rank} ---"
        for rank, out in sorted(results.items())
    )


def _resumed(actors: list[debug.PausedActor]) -> str:
    if not actors:
        return "no actor is paused on this host"
    return "resumed: " + ", ".join(a.name for a in actors)
