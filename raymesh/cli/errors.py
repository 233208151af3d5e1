"""How a command ends when something goes wrong: one line on stderr, `raymesh <command>:
<what and the fix>`, never a traceback, and the exit status saying whose the fault was.

    2 (USAGE): a user mistake, found before anything ran (a bad job file, a missing flag).
    1 (FAILED): the work itself failed (a training job that could not heal, a server that
      refused a reload).

Every command runs through `run`, so they all answer the same error the same way.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["FAILED", "USAGE", "run", "say"]

USAGE = 2
FAILED = 1


def say(command: str, message: object, code: int) -> int:
    """Print `raymesh <command>: <message>` on stderr; returns `code`, the exit status."""
    print(f"raymesh {command}: {message}", file=sys.stderr)
    return code


def run(
    command: str,
    body: Callable[[], int],
    *,
    mistakes: tuple[type[BaseException], ...] = (ValueError,),
) -> int:
    """`body()`'s exit status. A user mistake (`mistakes`: ValueError, which every config
    raises naming the field and the fix) is one line and USAGE; a training job that failed
    (raymesh.train's TrainError, TooManyFailures) one line and FAILED; anything else is a bug
    and keeps its traceback."""
    try:
        return body()
    except mistakes as e:
        return say(command, e, USAGE)
    except Exception as e:
        if _failed_job(e):
            return say(command, e, FAILED)
        raise


def _failed_job(error: Exception) -> bool:
    # Such an error exists only once raymesh.train is imported: the CLI does not import it
    # (and torch) for the commands that need neither.
    train = sys.modules.get("raymesh.train")
    return train is not None and isinstance(error, (train.TrainError, train.TooManyFailures))
