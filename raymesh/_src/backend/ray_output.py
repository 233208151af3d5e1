"""Ray's output in this process: which of its lines print, and which go to the `raymesh.ray`
logger at DEBUG instead (`raymesh train --verbose` shows them).

- `quiet_raylet_noise`: the raylet's paragraph on each dead worker and its worker-count warning
  (raymesh reports a proc's death itself, in one line naming the mesh, the rank and the signal;
  and runs more processes than cores by design), and lines of other jobs' workers;
- `quiet_token_auth_notice`: the notice a new local Ray prints that it enabled token
  authentication (the embedded Ray is raymesh's choice);
- `forward_output_of`: the output of procs adopted from the local runtime, which belong to the
  runtime's Ray job, printed here as this program's own workers' is (`forget_adopted` at
  shutdown).

`runtime` installs the first two as it connects; nothing here connects to Ray.
"""

from __future__ import annotations

import logging
import threading

import ray

__all__ = [
    "forget_adopted",
    "forward_output_of",
    "quiet_raylet_noise",
    "quiet_token_auth_notice",
    "ray_logger",
]

_lock = threading.Lock()

# The raylet's messages raymesh tells better, or that are no news in a raymesh program: a
# worker's death (supervision names the mesh, the rank and the signal), and the count of
# worker processes once a node has more than it has cores (every proc, warm or not, is one).
_RAYLET_NOISE = (
    "A worker died or was killed while executing a task",
    "worker processes have been started on node",
)
ray_logger = logging.getLogger("raymesh.ray")  # Ray's messages that raymesh tells better


# The local runtime's procs this program adopted: they are workers of the runtime's Ray job,
# not of this program's, so Ray would not forward their output here (see `forward_output_of`).
_adopted: set[int] = set()
_job_hex = ""


def forward_output_of(pids: list[int]) -> None:
    """Print the output of these procs (adopted from the local runtime) as Ray prints that of
    this program's own workers: attached, Ray's driver receives every job's lines, and keeps
    its own job's and these (`_ours`)."""
    global _job_hex
    from ray._private import worker as ray_worker

    with _lock:
        _adopted.update(pids)
        if not _job_hex:
            _job_hex = ray.get_runtime_context().get_job_id()
            ray_worker.global_worker._filter_logs_by_job = False


def _ours(data: dict) -> bool:
    job = data.get("job")
    return not _job_hex or not job or job == _job_hex or data.get("pid") in _adopted


def _is_noise(line: str) -> bool:
    return any(marker in line for marker in _RAYLET_NOISE)


def quiet_raylet_noise() -> None:
    """Ray's driver prints a paragraph to stdout for every worker process that dies ("A worker
    died or was killed while executing a task by an unexpected system error ... (1) the
    process was killed by the OOM killer ..."), in the middle of the user's progress bar,
    while raymesh's supervision reports the same death in one line that names the mesh, the
    rank and the signal; and it warns of "N PYTHON worker processes have been started" once
    a node runs more processes than cores, which a raymesh program (a proc is one, warm or
    not) does by design. Those go to the `raymesh.ray` logger at DEBUG instead (`raymesh
    train --verbose` shows them); Ray's other messages print as Ray prints them.
    Ray calls its module's `print_to_stdstream` for each; where a Ray release has no such
    function, nothing changes."""
    from ray._private import worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None or getattr(original, "raymesh_quiet", False):
        return

    def print_to_stdstream(data: dict, ignore_prefix: bool) -> None:
        lines = data.get("lines") or []
        if data.get("pid") == "raylet" and lines and all(_is_noise(x) for x in lines):
            for line in lines:
                ray_logger.debug("(raylet) %s", line)
            return
        if not _ours(data):
            return
        original(data, ignore_prefix)

    print_to_stdstream.raymesh_quiet = True  # type: ignore[attr-defined]
    ray_worker.print_to_stdstream = print_to_stdstream


class _ToDebug(logging.Filter):
    """Sends a Ray logger's records that start with `prefix` to `raymesh.ray` at DEBUG
    instead of the terminal."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.prefix):
            return True
        ray_logger.debug("%s", message)
        return False


def quiet_token_auth_notice() -> None:
    """A new local Ray enables token authentication (its default, kept) and warns that it did,
    at every start; the embedded Ray is raymesh's choice, not news to the user, so the notice
    goes to `raymesh.ray` at DEBUG. Its warnings that authentication is off still print."""
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(isinstance(f, _ToDebug) for f in notice.filters):
        notice.addFilter(_ToDebug("Token authentication is enabled for this Ray cluster"))


def forget_adopted() -> None:
    """Forget the adopted procs and this program's job (Ray was shut down)."""
    global _job_hex
    with _lock:
        _job_hex = ""
        _adopted.clear()
