"""raymesh: meshes of processes and actors for distributed PyTorch, on Ray.

One controller script spawns meshes of procs and actors and messages them; see docs/ for the
programming model and its guarantees.
"""

import sys

from raymesh._src.supervision import FrontModule
from raymesh._version import __version__
from raymesh.actor import *  # noqa: F403  (the programming model is the package's front)
from raymesh.actor import __all__ as _actor_all

__all__ = ["__version__", *_actor_all]

del unhandled_fault_hook  # noqa: F821  (star-imported above: the attribute is FrontModule's)
sys.modules[__name__].__class__ = FrontModule
