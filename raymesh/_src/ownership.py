"""What an actor owns: the meshes it spawned, stopped before it is (Monarch's recursive stop).

A proc mesh or an actor mesh spawned from inside an actor is registered here under that actor's
key. When the actor stops (its actor mesh's `stop()`, or its proc mesh's), the proc runtime
stops what it owns first, newest first, then runs its `__cleanup__`. A module of its own so that
the proc runtime, a layer below the mesh modules, stops what they registered without importing
them. Meshes the controller spawns are not registered: they end with the controller.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("raymesh")

__all__ = ["disown", "own", "stop_owned"]

_lock = threading.Lock()
_owned: dict[str, dict[int, tuple[str, Callable[[], Any]]]] = {}  # owner -> id(mesh) -> stop


def own(owner_key: str | None, mesh: object, name: str, stop: Callable[[], Any]) -> None:
    """Register `mesh` (kept alive by `stop`) as owned by the actor `owner_key`."""
    if owner_key is None:
        return
    with _lock:
        _owned.setdefault(owner_key, {})[id(mesh)] = (name, stop)


def disown(owner_key: str | None, mesh: object) -> None:
    """`mesh` was stopped by other means: its owner no longer needs to stop it."""
    if owner_key is None:
        return
    with _lock:
        owned = _owned.get(owner_key)
        if owned is not None:
            owned.pop(id(mesh), None)
            if not owned:
                del _owned[owner_key]


def stop_owned(owner_key: str) -> None:
    """Stop every mesh `owner_key` owns, the newest first (an actor mesh before the procs it
    may run on). A mesh that fails to stop is logged; the others are still stopped."""
    with _lock:
        owned = list(_owned.pop(owner_key, {}).values())
    for name, stop in reversed(owned):
        try:
            stop()
        except Exception:
            logger.warning(
                "raymesh: stopping %r (owned by %s) failed", name, owner_key, exc_info=True
            )
