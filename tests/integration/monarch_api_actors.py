"""Actor classes for tests/integration/test_monarch_api.py (importable by the procs)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import TextIO

from raymesh import Actor, current_rank, endpoint, get_or_spawn_controller


class Summand(Actor):
    """Replies with its rank plus what it was told, after a delay that grows with its rank."""

    def __init__(self) -> None:
        self.value = current_rank().rank

    @endpoint
    def value_plus(self, extra: int = 0, delay: float = 0.0) -> int:
        time.sleep(delay * current_rank().rank)
        return self.value + extra

    @endpoint
    def bump(self) -> None:
        self.value += 100

    @endpoint
    def fail_at(self, rank: int) -> int:
        if current_rank().rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return current_rank().rank

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Registry(Actor):
    """A controller: counts its constructions (in a file) and the visits it gets."""

    def __init__(self, constructions: str | None = None) -> None:
        if constructions is not None:
            with open(constructions, "a") as f:
                f.write(f"{os.getpid()}\n")
        self.visits = 0

    @endpoint
    def visit(self) -> int:
        self.visits += 1
        return self.visits

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)


class OtherRegistry(Actor):
    @endpoint
    def pid(self) -> int:
        return os.getpid()


class StartsOnSecondTry(Actor):
    """Its constructor raises until `flag` exists."""

    def __init__(self, flag: str) -> None:
        if not Path(flag).exists():
            raise RuntimeError(f"{flag} does not exist yet")

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class Asker(Actor):
    """Asks for a controller from inside an actor."""

    @endpoint
    def visit(self, name: str) -> tuple[int, int]:
        """(the controller's pid, its visit count after this visit)."""
        controller = get_or_spawn_controller(name, Registry).get(timeout=60)
        return controller.pid.call_one().get(timeout=30), controller.visit.call_one().get(
            timeout=30
        )

    @endpoint
    def pid(self) -> int:
        return os.getpid()


class AsyncAsker(Actor):
    """The same, awaiting."""

    @endpoint
    async def visit_async(self, name: str) -> int:
        controller = await get_or_spawn_controller(name, Registry)
        return await controller.visit.call_one()


class Talker(Actor):
    """Prints and logs a line (for ProcMesh.logging_option)."""

    @endpoint
    def say(self, line: str) -> int:
        import logging

        print(f"print {line}", flush=True)
        logging.getLogger("talker").info("info %s", line)
        sys.stderr.flush()
        return os.getpid()

    @endpoint
    def capture(self, message: str, *args: object) -> str:
        """What a bare `%(message)s` handler prints for `logger.warning(message, *args)`."""
        import io
        import logging

        out = io.StringIO()
        handler = logging.StreamHandler(out)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.getLogger("talker.capture")
        logger.addHandler(handler)
        try:
            logger.warning(message, *args)
        finally:
            logger.removeHandler(handler)
        return out.getvalue().rstrip("\n")


class Tidy(Actor):
    """Writes `path` from its __cleanup__ (for shutdown_context)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    def __cleanup__(self, exc: Exception | None) -> None:
        Path(self.path).write_text(f"cleaned {exc}")


class Farewell(Actor):
    """Writes numbered lines to its stdout and stderr up to its very end (for the flush
    barrier): `chat` a burst of `chat_lines`; `__cleanup__` three, with print; an `atexit`
    handler, the last code a stopped proc runs, a burst of `atexit_lines` at the descriptors
    and then, on stdout, a line without its newline that only the proc's exit flushes."""

    def __init__(self, chat_lines: int, atexit_lines: int) -> None:
        import atexit

        self.chat_lines = chat_lines
        atexit.register(_farewell, atexit_lines, sys.stdout)

    @endpoint
    def chat(self) -> int:
        _burst("chat", self.chat_lines)
        return os.getpid()

    @endpoint
    def lose_logs(self) -> None:
        """Remove this proc's log files, which Ray's log monitor tails (as it moves files away
        when it tails too many): no marker can be appended to them any more."""
        for fd in (1, 2):
            os.unlink(os.readlink(f"/proc/self/fd/{fd}"))

    def __cleanup__(self, exc: Exception | None) -> None:
        for i in range(3):
            print(f"cleanup {i}")
            print(f"cleanup {i}", file=sys.stderr)


def _burst(kind: str, n: int) -> None:
    lines = "".join(f"{kind} {i}\n" for i in range(n)).encode()
    os.write(1, lines)
    os.write(2, lines)


def _farewell(n: int, stdout: TextIO) -> None:
    _burst("atexit", n)
    stdout.write("tail")  # no newline, no flush
