"""How a proc ends when its mesh is stopped: as a Python program ends, without the slow part.

`ProcMesh.stop()` asks each proc to exit (Monarch stops procs gracefully too, so that a proc's
finalizers run). Python's own ending, after Ray's `exit_actor`, is unreliable here: Ray ends
the process from its own threads once it has drained the worker, which can cut the
interpreter's teardown short, and that teardown costs about 0.6 s of CPU in a process that
imported torch (its modules and C++ static objects). So `finalize()` does, in the proc's `exit`
call and before Ray is asked to end it, what a program can observe of its ending:

- the `atexit` handlers run (the program's, torch's), newest first, as at exit; Ray's own
  shutdown handler is left out: Ray ends the worker itself;
- the globals of the program's own modules (`__main__` first, then the others, newest first:
  any module not from the Python installation, its site-packages, Ray or raymesh) are cleared
  as the interpreter clears them (names starting with `_` first), then the cyclic garbage is
  collected, so their objects' `__del__` run;
- stdout and stderr are flushed, and a last `atexit` handler ends the process with status 0
  as soon as Python starts to exit, skipping the rest of the teardown.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import sysconfig
import types

import ray

__all__ = ["finalize"]


def finalize() -> None:
    """Run this proc's finalizers now (see the module docstring); the caller then asks Ray to
    end the process. Nothing it raises stops the exit."""
    try:
        atexit.unregister(ray._private.worker.shutdown)  # Ray ends this worker itself
        atexit._run_exitfuncs()  # and forgets them: they do not run twice
        _clear_program_modules()
        gc.collect()
    except BaseException:  # a finalizer that failed: the proc still ends
        pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed or redirected stream: nothing to flush
            pass
    atexit.register(os._exit, 0)


def _clear_program_modules() -> None:
    library = tuple(
        os.path.realpath(p)
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if (p := sysconfig.get_paths().get(key))
    )
    mains: list[types.ModuleType] = []
    others: list[types.ModuleType] = []
    for name, module in list(sys.modules.items()):  # in the order they were imported
        if module is None or name.split(".")[0] in ("ray", "raymesh"):
            continue
        path = getattr(module, "__file__", None)
        if not path or os.path.realpath(path).startswith(library):
            continue  # a proc's own __main__ is Ray's worker loop, still running: kept too
        (mains if name == "__main__" else others).append(module)
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
