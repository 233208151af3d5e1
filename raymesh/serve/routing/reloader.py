"""The reloader: moves every replica of the pool to new weights with no failed request.

One replica at a time is held out of rotation while it loads, after its batch in flight has
finished on the old weights; the others keep serving. A checkpoint that does not load on one
replica is rolled back on those already moved, so every replica serves the old weights again
(ValueError). A replica lost while it loads is replaced by one that starts with the new weights
(the pool's `spec`); one that was starting when the reload began is brought up to date when it
joins (`reload_slot`, from the router).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from pathlib import Path

from raymesh.actor import ActorError
from raymesh.serve.model import ModelSpec, check_under_root
from raymesh.serve.routing.pool import ReplicaPool, Slot, wait_reply

logger = logging.getLogger("raymesh.serve")

__all__ = ["Reloader"]


class Reloader:
    """pump: called when a replica comes back into rotation (it may take work at once). A
    replica's load is bounded as its start is (the pool's `start_timeout_s`)."""

    def __init__(self, pool: ReplicaPool, *, pump: Callable[[], None]) -> None:
        self.pool = pool
        self._pump = pump
        self._reloading = False

    async def reload(self, checkpoint: str, root: Path | None = None) -> str:
        """Move every replica to `checkpoint`, one at a time, each out of rotation while it
        loads (the others keep serving). Returns the step folder loaded. Raises ValueError,
        with every replica back on the old weights, if the new checkpoint does not load.

        root: load only from under this folder (HTTP's checkpoint_root): PermissionError,
        before anything is read, for a path outside it, and before anything is loaded when
        the step folder found, or a file in it, links out of it.

        A checkpoint served alone is rebuilt as deploy decided (`ModelSpec.pinned`): a new
        checkpoint whose job names another build function is refused (PermissionError), and
        no module its manifest names is imported."""
        if self._reloading:
            raise RuntimeError("a reload is already in progress; wait for it")
        self._reloading = True
        try:
            new = await self.pool.blocking(functools.partial(self._resolve, checkpoint, root))
            old, self.pool.spec = self.pool.spec, new
            done: list[Slot] = []
            for slot in list(self.pool.slots):
                try:
                    await self.reload_slot(slot, new)
                except ActorError as e:
                    self.pool.spec = old
                    for back in done:
                        await self.reload_slot(back, old)
                    raise ValueError(
                        f"checkpoint={checkpoint!r} did not load ({e.remote_type}: "
                        f"{e.remote_message}); every replica still serves {old.checkpoint}"
                    ) from None
                done.append(slot)
            logger.info("raymesh.serve: %d replica(s) now serve %s", len(done), new.checkpoint)
            return str(new.checkpoint)
        finally:
            self._reloading = False

    def _resolve(self, checkpoint: str, root: Path | None) -> ModelSpec:
        if root is not None:
            # Every file under the folder given, and what its manifest names, before anything
            # in it is read to decide (which step, how it is rebuilt).
            checkpoint = str(check_under_root(checkpoint, root, files=True))
        # A checkpoint alone keeps how deploy rebuilt it (`ModelSpec.pinned`): nothing its
        # manifest names is imported here, and another build is refused (PermissionError).
        new = dataclasses.replace(self.pool.spec, checkpoint=checkpoint).resolved()
        if root is not None and new.checkpoint is not None:
            # The replicas load the real path checked here, not a link that could be moved.
            real = check_under_root(new.checkpoint, root, files=True)
            new = dataclasses.replace(new, checkpoint=str(real))
        return new

    async def reload_slot(self, slot: Slot, spec: ModelSpec) -> None:
        """Load `spec` on `slot`'s replica, out of rotation meanwhile. Raises ActorError when
        it does not load; a replica lost meanwhile is left to the pool to replace."""
        slot.held = True
        try:
            # Its batch or streams in flight finish on the old weights. A replica lost meanwhile
            # leaves the slots with its work unfinished (resent elsewhere): its replacement
            # starts with the new spec, so there is nothing to wait for.
            while slot.working and slot in self.pool.slots:
                await asyncio.sleep(0.001)
            if slot not in self.pool.slots:
                return
            info = await asyncio.wait_for(
                wait_reply(slot.replica.actor.reload.call_one(spec)),
                self.pool.config.start_timeout_s,
            )
            slot.replica.info = info
        except ActorError:
            raise
        except Exception as e:  # lost while loading: the replacement loads `spec`
            self.pool.lose(slot, str(e).splitlines()[0][:200])
        finally:
            slot.held = slot.retiring
            self._pump()
