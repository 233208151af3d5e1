"""How a proc ends when its mesh is stopped: as a Python program ends, without the slow part.

`ProcMesh.stop()` asks each proc to exit (Monarch stops procs gracefully too, so that a proc's
finalizers run). Ray's `exit_actor` lets the calls in flight return and ends the process with
`sys.exit`, and Python then runs the `atexit` handlers and tears the interpreter down. The
teardown of a process that imported torch costs about 0.6 s of CPU (its modules and C++ static
objects), which a program that stops many meshes pays again and again. So `install()`
registers, before any user code runs, a last `atexit` handler that (only on this exit path)
does what the program can observe of the teardown and skips the rest:

- every other `atexit` handler has run (the program's, torch's), since it runs last of those
  registered after it; Ray's own handlers, registered earlier, are skipped: Ray has already
  ended the worker's calls;
- the globals of the program's own modules (`__main__` first, then the others, newest first:
  any module not from the Python installation, its site-packages, Ray or raymesh) are cleared
  as the interpreter clears them (names starting with `_` first), then the cyclic garbage is
  collected, so their objects' `__del__` run;
- stdout and stderr are flushed, and the process exits with status 0.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import sysconfig
import threading

__all__ = ["begin", "install"]

_exiting = threading.Event()
_installed = False


def install() -> None:
    """Register the last handler (once per process; a proc host calls it at start)."""
    global _installed
    if not _installed:
        _installed = True
        atexit.register(_finish)


def begin() -> None:
    """This proc is exiting because its mesh was stopped: `_finish` will run at exit."""
    _exiting.set()


def _finish() -> None:
    if not _exiting.is_set():
        return
    try:
        _clear_program_modules()
        gc.collect()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or redirected stream: nothing to flush
                pass
        os._exit(0)


def _clear_program_modules() -> None:
    library = tuple(
        os.path.realpath(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    )
    mains, others = [], []
    for name, module in list(sys.modules.items()):  # in the order they were imported
        if module is None or name.split(".")[0] in ("ray", "raymesh"):
            continue
        path = getattr(module, "__file__", None)
        if name == "__main__":
            mains.append(module)
        elif path and not os.path.realpath(path).startswith(library):
            others.append(module)
    for module in [*mains, *reversed(others)]:
        names = vars(module)
        for private in (True, False):  # as the interpreter: `_names` first, then the rest
            for key in [k for k in names if k.startswith("_") == private]:
                if key.startswith("__") and key.endswith("__"):
                    continue  # __name__, __builtins__, ...: kept for the __del__ that read them
                try:
                    names[key] = None
                except Exception:  # a __del__ that raised: ignored, as at teardown
                    pass
