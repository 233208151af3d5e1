"""Actor classes for tests/integration/test_monarch_api.py (importable by the procs)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

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
