"""`breakpoint()` in an actor: the actor pauses in pdb, served on a loopback socket
(`wire`) and listed for the debugger (`paused`), until a client resumes it.

Guarantees:
- Only the paused actor waits. A sync endpoint pauses its actor's own thread: the actor holds
  its turn, so its later messages queue in order (FIFO per caller is kept) and run once it
  resumes; the other actors of its proc, and every other rank, keep running (they pause only
  where they reach a `breakpoint()` of their own). An async endpoint pauses its proc's event
  loop, so the proc's other async actors wait too (as a blocking call there would make them).
- The session lasts until pdb resumes the actor: `c` with no breakpoints left, `q` (the
  endpoint then raises `bdb.BdbQuit`, which its caller gets as `ActorError`), a client that
  goes without detaching (as `c`), the endpoint returning (stepping past its end), or the
  actor being stopped (as `q`, so `stop()` is never held up by a pause). Its file and socket
  go with it.
- `PYTHONBREAKPOINT` is honoured: set (to `0`, or to another debugger), `breakpoint()` does
  what Python does with it. Ray sets it to its own debugger (`ray.util.rpdb...`) in every
  worker; that value is Ray's, not the user's, and raymesh's debugger takes its place in procs.
  Outside procs (the controller, a script) nothing changes.
- Post-mortem: an endpoint that raises an `Exception` pauses in pdb at the raise, before its
  caller gets the error, when its message already paused at a `breakpoint()` (Monarch's
  default), or for every endpoint when the proc's environment has
  `RAYMESH_DEBUG_POST_MORTEM=1`.
"""

from __future__ import annotations

import bdb
import logging
import os
import pdb
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from raymesh._src import backend
from raymesh._src import context as _ctx
from raymesh._src.actor import ActorStopped
from raymesh._src.backend.switches import switch
from raymesh._src.debugger import paused
from raymesh._src.debugger.wire import Wire

__all__ = ["install", "post_mortem", "release"]

logger = logging.getLogger("raymesh")

POST_MORTEM_ENV = "RAYMESH_DEBUG_POST_MORTEM"
# Frames of these modules call endpoints: the frame below one is the endpoint's own.
_CALLERS = ("raymesh._src.actor", "raymesh._src.proc_loop")

_lock = threading.Lock()
_sessions: dict[str, set[Session]] = {}  # actor key -> its open sessions
_by_thread: dict[int, Session] = {}  # thread id -> the session pausing it
# actor key -> the context of the last message that hit a breakpoint: a failure of that same
# message goes to post-mortem (contexts are made per message, so identity tells them apart).
_hit: dict[str, _ctx.ActorContext] = {}


class Session:
    """One paused actor: its pdb, its wire, its file."""

    def __init__(self, ctx: _ctx.ActorContext, reason: str, outer: FrameType | None) -> None:
        paused.check()  # a directory others could read fails here, before anything is open
        self.ctx = ctx
        self.reason = reason
        self.wire = Wire(self._on_attach)
        self.pdb = _RemotePdb(self, outer)
        self.since = time.time()
        self._file: Path | None = None
        self.closed = False
        self.thread = threading.get_ident()
        with _lock:
            _sessions.setdefault(ctx.actor_key, set()).add(self)
            _by_thread[self.thread] = self

    def paused_at(self, frame: FrameType | None) -> None:
        """Publish (or move) its file: pdb stopped at `frame`."""
        if self.closed:
            return
        code = frame.f_code if frame is not None else None
        inst = self.ctx.actor_instance
        actor = paused.PausedActor(
            mesh=self.ctx.mesh_name,
            actor_class=inst.class_name or "root",
            rank=self.ctx.rank.rank,
            coords=dict(self.ctx.rank),
            extent=dict(self.ctx.rank.extent),
            mesh_id=self.ctx.actor_key,
            proc=inst.proc_id,
            host=socket.gethostname(),
            pid=os.getpid(),
            job=backend.job_id(),
            port=self.wire.port,
            file=code.co_filename if code else "?",
            line=frame.f_lineno if frame is not None else 0,
            function=code.co_name if code else "?",
            reason=self.reason,
            since=self.since,
        )
        self._file = paused.write(actor, self.wire.token)

    def _on_attach(self) -> None:
        label = f"{self.ctx.mesh_name} rank {self.ctx.rank.rank} ({socket.gethostname()})"
        self.pdb.message(f"Attached to {label}, paused by {self.reason}")
        if self.pdb.curindex < len(self.pdb.stack):
            self.pdb.print_stack_entry(self.pdb.stack[self.pdb.curindex])
        self.wire.write(self.pdb.prompt)

    def close(self) -> None:
        """End it: the file goes, the client is disconnected, pdb's output goes nowhere."""
        with _lock:
            if self.closed:
                return
            self.closed = True
            group = _sessions.get(self.ctx.actor_key)
            if group is not None:
                group.discard(self)
                if not group:
                    del _sessions[self.ctx.actor_key]
            if _by_thread.get(self.thread) is self:
                del _by_thread[self.thread]
        if self._file is not None:
            paused.remove(self._file)
        self.wire.close()


class _RemotePdb(pdb.Pdb):
    """pdb over the session's wire; the session ends as pdb lets the actor go."""

    def __init__(self, session: Session, outer: FrameType | None) -> None:
        super().__init__(stdin=session.wire, stdout=session.wire, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.prompt = "(Pdb) "
        self._session = session
        self._outer = outer  # the endpoint's frame: the session ends when it returns

    def preloop(self) -> None:
        super().preloop()
        self._session.paused_at(self.curframe)

    def set_continue(self) -> None:
        super().set_continue()
        if not self.breaks:  # tracing is off: nothing will stop here again
            self._session.close()

    def set_quit(self) -> None:
        super().set_quit()
        self._session.close()

    def dispatch_return(self, frame: FrameType, arg: Any) -> Any:
        result = super().dispatch_return(frame, arg)
        if frame is self._outer and not self._session.closed:
            # The endpoint is done (or, async, suspended at an await): stepping on would walk
            # into raymesh's own frames and the actor's next message. Let it go.
            self.clear_all_breaks()
            self.set_continue()
        return result

    def do_clear(self, arg: str) -> Any:
        if arg:
            return super().do_clear(arg)
        self.clear_all_breaks()  # pdb would ask "Clear all breaks?" on the proc's own stdin
        self.message("Deleted all breakpoints")
        return None

    do_clear.__doc__ = pdb.Pdb.do_clear.__doc__
    do_cl = do_clear

    def do_interact(self, arg: str) -> Any:
        """interact
        Not over raymesh debug (it would read the proc's own stdin); run statements with `!`.
        """
        self.error("interact is not available over raymesh debug; run statements with `!`")
        return None


def _endpoint_frame(frame: FrameType) -> FrameType | None:
    """The outermost frame of the running endpoint (the one a raymesh caller called)."""
    while frame.f_back is not None:
        if frame.f_back.f_globals.get("__name__") in _CALLERS:
            return frame
        frame = frame.f_back
    return None


def breakpointhook(*args: Any, **kwargs: Any) -> Any:
    """`sys.breakpointhook` in a proc: pause the calling actor in a served pdb."""
    chosen = os.environ.get("PYTHONBREAKPOINT", "")
    # Ray sets it to its own debugger in every worker: that is no choice of the user's.
    if chosen and not chosen.startswith("ray.util."):
        return sys.__breakpointhook__(*args, **kwargs)  # Python's rules, with its variable
    frame = sys._getframe(1)
    ctx = _ctx.context()
    _hit[ctx.actor_key] = ctx
    with _lock:
        session = _by_thread.get(threading.get_ident())
    if session is None:
        session = Session(ctx, "breakpoint", _endpoint_frame(frame))
    session.pdb.set_trace(frame)
    return None


def install() -> None:
    """Make `breakpoint()` in this process pause in a served pdb (called as a proc starts)."""
    sys.breakpointhook = breakpointhook


def post_mortem(ctx: _ctx.ActorContext | None, error: BaseException) -> None:
    """If wanted (module docstring), pause in pdb at `error`'s raise; returns once resumed."""
    if not isinstance(error, Exception) or isinstance(error, (bdb.BdbQuit, ActorStopped)):
        return
    if ctx is None:
        return
    hit = _hit.get(ctx.actor_key) is ctx
    if hit:
        del _hit[ctx.actor_key]
    if not hit and not switch(
        POST_MORTEM_ENV,
        False,
        on="an endpoint that raises pauses in pdb",
        off="only after a breakpoint()",
    ):
        return
    tb: TracebackType | None = error.__traceback__
    if tb is None:
        return
    what = "".join(traceback.format_exception_only(type(error), error)).strip()
    try:
        session = Session(ctx, f"post-mortem: {what}", None)
    except Exception:  # the error goes to its caller all the same
        logger.exception("raymesh: no post-mortem for %s", ctx.actor_key)
        return
    try:
        session.pdb.reset()
        session.pdb.interaction(None, tb)
    except bdb.BdbQuit:
        pass  # `q`: the error still goes to the caller
    finally:
        session.close()


def release(actor_key: str) -> None:
    """The actor is being stopped: its paused sessions quit at once."""
    with _lock:
        sessions = list(_sessions.get(actor_key, ()))
        _hit.pop(actor_key, None)
    for session in sessions:
        session.wire.quit()
