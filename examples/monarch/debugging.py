"""Monarch's "Debugging Python Actors with pdb" docs example (docs/source/examples/debugging.py),
on raymesh: the same program with `raymesh` in place of `monarch` in the imports, and
`raymesh debug` in place of `monarch debug`.

    python examples/monarch/debugging.py          # then, in another terminal: raymesh debug
    python examples/monarch/debugging.py --drive  # the session below, typed by the script

The program pauses its 16 actors at a `breakpoint()` and waits for a debugger. Alone it is
interactive, as Monarch's is; `--drive` (raymesh's addition, for a run nobody watches) starts a
thread that types, at `raymesh debug`'s own prompt, what Monarch's text walks through: `list`,
`attach debugee 13` with `s`, `n`, `rank`, `detach`, three `cast`s, `continue`, the post-mortem
stops, `continue` again. As in Monarch, the ranks with `rank % 4 == 2` raise, so the final
`get()` raises `ActorError` and the script ends with status 1.

Differences, each where it stands below: raymesh has no debug server for the client to find
(`MONARCH_DEBUG_SERVER_HOST`/`_PORT`, `--host`/`--port`): the paused actors are listed in the
user's runtime directory of the host and listen on its loopback, so run `raymesh debug` on the
host where they run. Monarch's cast example names an axis `gpus` that its mesh calls `gpu`;
raymesh refuses an axis the mesh lacks, so the driven session writes `gpu`.
"""

# %%
# Defining an Actor with Breakpoints
# -----------------------------------
# To debug an actor, insert `breakpoint()` in the endpoint you want to debug. Debug sessions
# are indexed by actor mesh name + rank.

import sys
import threading
import time

from raymesh.actor import Actor, current_rank, endpoint, this_host


def _bad_rank():
    raise ValueError("bad rank")


def _debugee_actor_internal(rank):
    if rank % 4 == 0:
        rank += 1
        return rank
    elif rank % 4 == 1:
        rank += 2
        return rank
    elif rank % 4 == 2:
        rank += 3
        _bad_rank()
    elif rank % 4 == 3:
        rank += 4
        return rank


class DebugeeActor(Actor):
    @endpoint
    def to_debug(self):
        rank = current_rank().rank
        breakpoint()
        return _debugee_actor_internal(rank)


# %%
# The debugger session, typed by a thread (raymesh's addition, `--drive`)
# ----------------------------------------------------------------------
# Each line is what a user types at `raymesh debug`; a callable waits first for the actors
# to reach the state the next line needs (a user would look at `list`).


def _wait_paused(count: int, reason: str) -> str:
    from raymesh import debug

    deadline = time.monotonic() + 120
    while True:
        found = [a for a in debug.list_paused() if a.mesh == "debugee"]
        if len(found) == count and all(a.reason.startswith(reason) for a in found):
            return "list"
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} actors did not pause ({reason}) within 120 s")
        time.sleep(0.2)


SESSION = [
    lambda: _wait_paused(16, "breakpoint"),
    "attach debugee 13",
    "s",
    "n",
    "rank",
    "detach",
    "cast debugee ranks(0,1) n",
    "cast debugee ranks(2:7:2) s",
    "cast debugee ranks(host=2:4, gpu=1:3) c",
    # ranks 10 and 14 raised: each pauses at the raise (post-mortem); 9 and 13 returned
    lambda: _wait_paused(14, ""),
    "continue",
    lambda: _wait_paused(2, "post-mortem"),  # ranks 2 and 6, which `s` took into the helper
    "continue",
    "quit",
]


def _drive() -> None:
    from raymesh import debug
    from raymesh.cli.debug import repl

    lines = iter(SESSION)

    def read(prompt: str) -> str:
        line = next(lines, "quit")
        line = line() if callable(line) else line
        print(prompt + line, flush=True)
        return line

    try:
        repl(read=read)
    finally:  # a session that went wrong must not leave the program paused for ever
        deadline = time.monotonic() + 30
        while debug.continue_all() and time.monotonic() < deadline:
            time.sleep(0.5)  # a rank resumed may pause again at its raise


# %%
# Running the program
# -------------------

if __name__ == "__main__":
    # Create a mesh with 4 "hosts" and 4 gpus per "host"
    process_mesh = this_host().spawn_procs(per_host={"host": 4, "gpu": 4})

    # Spawn the actor you want to debug on the mesh
    debugee_mesh = process_mesh.spawn("debugee", DebugeeActor)

    if "--drive" in sys.argv:
        threading.Thread(target=_drive, daemon=True).start()

    # Call the endpoint you want to debug
    print(debugee_mesh.to_debug.call().get())


# %%
# Using the debugger
# ------------------
# From a separate terminal on the same host, run `raymesh debug`:
#
#     raymesh debugger: `help` for the commands, `list` for the paused actors
#     raymesh_dbg>
#
# `list` shows a table of the actors stopped at a breakpoint: mesh name, rank, coordinates,
# host, function, file and line, why it paused, and its program's Ray job.
#
# Attaching to a specific actor: `attach debugee 13`, then any pdb command (`s`, `n`, `rank`).
# `detach` comes back to the raymesh_dbg prompt and leaves the actor paused; `c` resumes it.
#
# Casting commands to many actors: `cast <mesh> ranks(<ranks>) <pdb command>`, with
# ranks(3), ranks(1,4,6), ranks(start:stop:step), ranks(host=2:4, gpu=1:3); each rank's output
# is printed under its rank.
#
# Post-mortem: an endpoint that raises after its message stopped at a breakpoint stops again
# where the error was raised (here ranks 2, 6, 10 and 14); RAYMESH_DEBUG_POST_MORTEM=1 in the
# procs' environment does so for every endpoint.
#
# Continuing: `continue` (or `c`) clears every breakpoint and resumes every paused actor.
