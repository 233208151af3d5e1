"""The debugger's client: list the paused actors of this host, attach to one, cast a pdb command
to many (`raymesh.debug`, `raymesh debug`).

Guarantees:
- Every wait is bounded: connecting, the token's answer, and each command's answer (`timeout`;
  an interactive `interact()` waits for a step as long as it runs, and Ctrl-C detaches).
- A mistake is a `DebugError` naming it and the fix: a name nothing paused has, a rank that is
  not paused, a `ranks(...)` naming ranks the mesh does not have, an actor that is gone.
- Detaching leaves the actor paused for the next client; `c` (or `continue_all`) resumes it.
"""

from __future__ import annotations

import codecs
import socket
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from raymesh._src.backend.runtime_file import RuntimeDirError
from raymesh._src.debugger import paused
from raymesh._src.debugger.paused import PausedActor
from raymesh._src.debugger.ranks import parse_ranks, select
from raymesh._src.debugger.wire import DETACH, PROMPT_MARK

__all__ = ["DebugError", "DebugSession", "attach", "cast", "continue_all", "list_paused"]

_PROMPT = "(Pdb) "
_DETACH_WAIT_S = 5.0
_Entry = tuple[PausedActor, str, Path]


class DebugError(RuntimeError):
    """A debugger command that cannot be carried out; the message says why and what to do."""


class _Gone(DebugError):
    """The actor is no longer paused (it resumed, or its proc ended)."""


def list_paused(job: str | None = None) -> list[PausedActor]:
    """The actors paused in pdb on this host (this user's), by mesh and rank; `job`: only
    those of that Ray job (program)."""
    return [a for a, _, _ in _entries(job)]


def attach(name: str, rank: int, *, job: str | None = None, timeout: float = 10.0) -> DebugSession:
    """Attach to rank `rank` of the paused actor mesh `name` (its spawn name, or its class's
    name). DebugError when it is not paused, or another client is attached."""
    entry = _pick(name, job, rank)
    return _connect(entry, timeout)


def cast(
    name: str,
    ranks: str | int | Iterable[int] | range,
    command: str,
    *,
    job: str | None = None,
    timeout: float = 30.0,
) -> dict[int, str]:
    """Send one pdb command to the paused ranks of `name` that `ranks` selects (`"ranks(0:4)"`,
    `"0:4"`, `3`, `[0, 2]`, `"ranks(hosts=0, gpus=1:3)"`), at once; returns each rank's
    output. Ranks the mesh does not have are a DebugError before anything is sent; selected
    ranks that are not paused are skipped (none paused is a DebugError). A rank that does not
    answer within `timeout`, or is gone, is a DebugError once every other rank has answered."""
    selection = parse_ranks(ranks)
    found = _named(name, job)
    try:
        wanted = select(selection, found[0][0].extent)
    except ValueError as e:
        raise DebugError(f"cast to {found[0][0].mesh}: {e}") from None
    targets = [e for e in found if e[0].rank in wanted]
    if not targets:
        have = ", ".join(str(e[0].rank) for e in found)
        raise DebugError(
            f"no rank of {found[0][0].mesh} in {selection.text} is paused (paused: ranks "
            f"{have}); `list` shows what is paused"
        )
    done = _cast_to(targets, [command], timeout)
    return {rank: out for (_, rank), out in done.items()}


def continue_all(*, job: str | None = None, timeout: float = 30.0) -> list[PausedActor]:
    """Monarch's `continue`: clear every breakpoint and resume every paused actor (of `job`).
    Returns the actors resumed."""
    entries = _entries(job)
    if not entries:
        return []
    done = _cast_to(entries, ["clear", "continue"], timeout, skip_gone=True)
    return [a for a, _, _ in entries if (a.mesh_id, a.rank) in done]


class DebugSession:
    """A client attached to one paused actor (`attach`). `send(command)` returns pdb's
    output; `resumed` turns True once a command resumed the actor (the connection is then
    closed); `detach()` leaves it paused. A context manager that detaches on exit."""

    def __init__(self, actor: PausedActor, sock: socket.socket, timeout: float) -> None:
        self.actor = actor
        self._sock = sock
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._buf = ""
        self.resumed = False
        self._closed = False
        self._owed = False  # a command's answer is still on its way (send timed out)
        self.intro = _strip_prompt(self._until_mark(timeout))  # where pdb stopped

    def send(self, command: str, timeout: float | None = 30.0) -> str:
        """Run one pdb command; its output (without the prompt). After a command that resumes
        the actor (`c`, `q`), `resumed` is True and the session is over. TimeoutError when
        no answer came within `timeout` (the command still runs: its output comes first in
        the next `send`)."""
        return _strip_prompt(self.command(command, timeout))

    def command(self, command: str, timeout: float | None) -> str:
        """`send`, keeping pdb's prompt at the end of the output (for a terminal)."""
        if self._closed:
            raise DebugError(f"the session with {self.actor.name} is over (attach again)")
        if "\n" in command or command.startswith(PROMPT_MARK):
            raise ValueError(f"command={command!r}: give one pdb command, without newlines")
        before = self._until_mark(timeout) if self._owed else ""
        self._sock.sendall((command + "\n").encode())
        self._owed = True
        return before + self._until_mark(timeout)

    def detach(self) -> None:
        """Leave the actor paused and free for the next client (idempotent). Returns once
        the actor has let go of this client (it closes the connection), so that an `attach`
        right after is not refused as a second client; at most `_DETACH_WAIT_S` (a step
        still running holds it)."""
        if self._closed:
            return
        self._closed = True
        try:
            if not self.resumed:
                self._sock.sendall((DETACH + "\n").encode())
                self._sock.settimeout(_DETACH_WAIT_S)
                while self._sock.recv(65536):
                    pass  # what pdb still says to this client: nobody reads it now
        except OSError:  # TimeoutError included
            pass
        self._sock.close()

    def interact(
        self,
        read: Callable[[], str] | None = None,
        write: Callable[[str], object] | None = None,
    ) -> None:
        """A pdb prompt on this terminal (`read`, `write`: stdin's lines and stdout) until
        `detach` (or Ctrl-D, Ctrl-C) or the actor resumes."""
        read = read or input
        write = write or _write_stdout
        write(self.intro + "(`detach` leaves it paused, `c` resumes it)\n" + _PROMPT)
        try:
            while not self.resumed:
                line = read()
                if line.strip() == "detach":
                    break
                write(self.command(line, timeout=None))
        except (EOFError, KeyboardInterrupt):
            write("\n")
        if self.resumed:
            write(f"{self.actor.name} resumed\n")
        else:
            self.detach()
            write(f"Detached from {self.actor.name}; it stays paused\n")

    def _until_mark(self, timeout: float | None) -> str:
        """The output up to pdb's next wait for a command (or to the end: the actor resumed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while PROMPT_MARK not in self._buf and not self.resumed:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"{self.actor.name} did not answer within {timeout}s (a step still "
                        "running?); its output comes with the next command"
                    )
                self._sock.settimeout(left)
            else:
                self._sock.settimeout(None)
            try:
                chunk = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.resumed = self._closed = True
                self._sock.close()
                break
            self._buf += self._decoder.decode(chunk)
        out, _, self._buf = self._buf.partition(PROMPT_MARK)
        self._owed = False
        return out

    def __enter__(self) -> DebugSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()


def _entries(job: str | None) -> list[_Entry]:
    try:
        found = paused.entries()
    except RuntimeDirError as e:  # open to other users: its tokens cannot be trusted
        raise DebugError(str(e)) from None
    return [e for e in found if job is None or e[0].job == job]


def _named(name: str, job: str | None) -> list[_Entry]:
    """The paused ranks of the actor mesh `name` (by spawn name, else by class name)."""
    everything = _entries(job)
    found = [e for e in everything if e[0].mesh == name]
    if not found:
        found = [e for e in everything if e[0].actor_class.rpartition(".")[2] == name]
    if not found:
        now = ", ".join(sorted({e[0].mesh for e in everything})) or "none"
        raise DebugError(
            f"no actor named {name!r} is paused on this host (paused meshes: {now}); `list` "
            "shows them, by the name they were spawned with"
        )
    meshes = {e[0].mesh_id: e[0] for e in found}
    if len(meshes) > 1:
        jobs = ", ".join(sorted({a.job for a in meshes.values()}))
        raise DebugError(
            f"{name!r} names {len(meshes)} paused actor meshes (jobs {jobs}); pick one with "
            "job=... (`--job` on the command line)"
        )
    return found


def _pick(name: str, job: str | None, rank: int) -> _Entry:
    found = _named(name, job)
    mesh = found[0][0]
    if not 0 <= rank < mesh.size:
        raise DebugError(f"{mesh.mesh} has no rank {rank}: its ranks are 0..{mesh.size - 1}")
    for entry in found:
        if entry[0].rank == rank:
            return entry
    have = ", ".join(str(e[0].rank) for e in found)
    raise DebugError(
        f"{mesh.mesh} rank {rank} is not paused (paused ranks of {mesh.mesh}: {have}); attach "
        "to one of those, or wait for it to reach a breakpoint"
    )


def _connect(entry: _Entry, timeout: float) -> DebugSession:
    actor, token, path = entry
    if actor.host != socket.gethostname():
        raise DebugError(f"{actor.name} is paused on host {actor.host}: run `raymesh debug` there")
    try:
        sock = socket.create_connection(("127.0.0.1", actor.port), timeout=timeout)
    except OSError:
        paused.remove(path)
        raise _Gone(
            f"{actor.name} is no longer paused (it resumed, or its proc ended); `list` shows "
            "what is paused now"
        ) from None
    try:
        sock.sendall((token + "\n").encode())
        answer = _first_line(sock)
    except OSError:
        answer = "refused: the connection closed"
    if answer != "ok":
        sock.close()
        why = answer.removeprefix("refused: ")
        raise DebugError(f"{actor.name} refused the connection: {why}")
    try:
        return DebugSession(actor, sock, timeout)
    except TimeoutError:
        try:  # leave it free for the next client
            sock.sendall((DETACH + "\n").encode())
        except OSError:
            pass
        sock.close()
        raise DebugError(
            f"{actor.name} did not show its pdb prompt within {timeout}s (it is running a "
            "step); try again"
        ) from None


def _first_line(sock: socket.socket) -> str:
    """The actor's answer to the token: one short line, read a byte at a time so that pdb's
    output after it stays in the socket for the session."""
    out = b""
    while not out.endswith(b"\n") and len(out) < 4096:
        byte = sock.recv(1)
        if not byte:
            break
        out += byte
    return out.decode("utf-8", "replace").strip()


def _cast_to(
    entries: list[_Entry], commands: list[str], timeout: float, *, skip_gone: bool = False
) -> dict[tuple[str, int], str]:
    """Send `commands` to every entry at once: (mesh id, rank) -> output. A rank that fails
    is a DebugError once all have answered; `skip_gone`: one no longer paused is left out."""

    def one(entry: _Entry) -> str:
        with _connect(entry, timeout) as session:
            out = []
            for command in commands:
                if not session.resumed:
                    out.append(session.send(command, timeout))
            return "".join(out)

    results: dict[tuple[str, int], str] = {}
    failures: list[str] = []
    reached: list[str] = []
    with ThreadPoolExecutor(max_workers=min(32, len(entries))) as pool:
        futures = [(e[0], pool.submit(one, e)) for e in entries]
        for actor, future in futures:
            try:
                results[(actor.mesh_id, actor.rank)] = future.result()
                reached.append(actor.name)
            except _Gone:
                if not skip_gone:
                    failures.append(f"{actor.name}: it is no longer paused")
            except (DebugError, TimeoutError, OSError) as e:
                failures.append(f"{actor.name}: {e}")
    if failures:
        got = ", ".join(reached) or "none"
        raise DebugError(f"the command reached {got} but not " + "; ".join(failures))
    return results


def _strip_prompt(text: str) -> str:
    return text[: -len(_PROMPT)] if text.endswith(_PROMPT) else text


def _write_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
