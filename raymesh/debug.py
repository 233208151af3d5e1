"""The distributed debugger, Monarch's `monarch debug` from Python (`raymesh debug` on the
command line).

Put `breakpoint()` in an endpoint; the actor that reaches it pauses in pdb while the rest of the
mesh runs on. Then, from any process of the same user on that host:

    from raymesh import debug
    debug.list()                                  # the paused actors: mesh, rank, file, line
    debug.cast("trainer", "ranks(0:4)", "p loss")  # {rank: pdb's output}, for ranks 0..3
    with debug.attach("trainer", 1) as s:          # one actor's pdb
        print(s.intro)                            # where it stopped
        print(s.send("bt"))
        s.send("c")                               # resumes it (s.resumed is True)
    debug.continue_all()                          # clear breakpoints, resume every actor

An endpoint that raises after its message paused at a `breakpoint()` pauses again at the raise
(post-mortem); `RAYMESH_DEBUG_POST_MORTEM=1` in the procs' environment does so for every
endpoint. Mistakes (a name nothing paused has, a rank that is not paused, `ranks(7)` on a mesh
of 2) raise `DebugError` saying so. Only this user can attach: the tokens the sockets ask for
are in files of this user's alone (see `raymesh/_src/debugger/paused.py`).
"""

from raymesh._src.debugger.client import (
    DebugError,
    DebugSession,
    attach,
    cast,
    continue_all,
    list_paused,
)
from raymesh._src.debugger.paused import PausedActor
from raymesh._src.debugger.ranks import parse_ranks

list = list_paused  # Monarch's command name; `list_paused` where `list` would shadow the builtin

__all__ = [
    "DebugError",
    "DebugSession",
    "PausedActor",
    "attach",
    "cast",
    "continue_all",
    "list",
    "list_paused",
    "parse_ranks",
]
