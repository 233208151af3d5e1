"""The world: the ranks that train together, and how it is formed, healed and reshaped.

Forming a world is one process group generation with every rank holding the same state:
- DDP with a source rank (or its state, fetched before): the new ranks build, the survivors
  re-form, and all load the source's `ReplicaState` (a full replica, sent through the object
  store);
- FSDP and HSDP (or no source): every rank rebuilds in its warm process and loads the newest
  checkpoint, resharded for the new world (HSDP falls back to FSDP while the world does not
  split into its shard groups).

Ranks lost while a world forms (a replacement that dies as it joins, a survivor left stuck by
it) are replaced again until the world forms or the failure policy gives up; a DDP source's
state, once fetched, is kept here, so it survives the loss of its rank.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from typing import Any

from raymesh.actor import SupervisionError
from raymesh.train.config import CheckpointConfig
from raymesh.train.control.detection import settle
from raymesh.train.control.failure import FailureDecision, FailurePolicy, TooManyFailures
from raymesh.train.control.member import Rank
from raymesh.train.control.ranks import RankPool
from raymesh.train.control.resume import latest_checkpoint
from raymesh.train.hooks import TrainHooks
from raymesh.train.protocol import LostRank, Rendezvous, ReplicaState, SetupInfo
from raymesh.train.result import RunLog, TrainError
from raymesh.train.sections import FailureConfig, ScalingConfig
from raymesh.train.strategy import StrategyDecision
from raymesh.train.task import local_ranks

logger = logging.getLogger("raymesh")

__all__ = ["World", "WorldBroken", "replaced_by"]


class WorldBroken(Exception):
    """Ranks were lost while the world re-formed (the world heals again)."""

    def __init__(self, lost: list[LostRank], state: ReplicaState | None) -> None:
        super().__init__("; ".join(str(x) for x in lost))
        self.lost = lost
        self.state = state  # the DDP state fetched before it broke, kept for the next try


class World:
    """The current world and its strategy (see the module docstring)."""

    def __init__(
        self,
        scaling: ScalingConfig,
        failure: FailureConfig,
        checkpoint: CheckpointConfig | None,
        pool: RankPool,
        log: RunLog,
        *,
        failure_policy: FailurePolicy,
        hooks: TrainHooks | None = None,
    ) -> None:
        self.scaling = scaling
        self.failure = failure
        self.checkpoint = checkpoint
        self.pool = pool
        self.log = log
        self.failure_policy = failure_policy
        self.hooks = hooks
        self.decision: StrategyDecision | None = None  # the strategy now
        self.base: StrategyDecision | None = None  # the one decided at the start (resized)
        self.step = 0  # steps the world has completed (the data position)
        self.first_step = 0  # where the job's first world started (0, or a resumed position)
        self.generation = 0

    @property
    def ranks(self) -> list[Rank]:
        return self.pool.ranks

    def gather(self, futures: Sequence[Any]) -> list[Any]:
        return [f.get(timeout=self.failure.timeout_s) for f in futures]

    def _install(self, ranks: Sequence[Rank], *, rejoin: bool) -> None:
        """Give the ranks the hooks for the world they join, before they join it."""
        if self.hooks is not None:
            hooks = self.hooks.for_world(self.step + 1, rejoin=rejoin)
            # A rank that cannot take them (it died) fails its join next, where losses are seen.
            settle([r.worker.install.call_one(hooks) for r in ranks], 10.0)

    def _rendezvous(self, ranks: Sequence[Rank]) -> list[Rendezvous]:
        addr, port = ranks[0].worker.address.call_one().get(timeout=self.failure.timeout_s)
        local = local_ranks([r.node_id for r in ranks])
        n = len(ranks)
        return [Rendezvous(addr, port, i, n, local[i], self.step + 1) for i in range(n)]

    def start(self, ranks: list[Rank]) -> list[SetupInfo]:
        """Form the first world of `ranks`: each joins and builds, and measures its memory."""
        self.pool.set_world(ranks)
        self._install(ranks, rejoin=False)
        rdv = self._rendezvous(ranks)
        return self.gather([r.worker.setup.call_one(rdv[i]) for i, r in enumerate(ranks)])

    def prepare(self, decision: StrategyDecision, resume: str | None) -> int:
        """Wrap every rank's model as `decision` says, resized to this world (an elastic HSDP
        job started below max runs FSDP until it grows), and restore `resume`; the first
        step."""
        self.base = decision
        self.decision = decision.resized(len(self.ranks))
        start = self.gather([r.worker.prepare.call_one(self.decision, resume) for r in self.ranks])
        self.step = self.first_step = start[0]
        return self.step

    def decide(self, *, world: int, lost: int, replacements: int) -> FailureDecision:
        return self.failure_policy.decide(
            self.log.failures,
            world,
            replacements=replacements,
            lost=lost,
            min_workers=self.scaling.min_workers,
        )

    def replace_lost(
        self, ranks: list[Rank], lost: list[int]
    ) -> tuple[list[Rank], set[Rank], FailureDecision]:
        """Stop the ranks at positions `lost` (killing a hung one), and fill their places
        with spares or new procs within `replace_timeout_s`; places left empty are dropped
        (shrink), within the failure policy. Returns the new world (replacements take the lost
        ranks' places: same rank order, so the same reduction order, hence bitwise-equal
        results at the same world size), the replacements, and the decision."""
        for i in lost:  # make sure a rank that raised or hung is gone, its room freed
            ranks[i].stop(kill=True)
        got = self.pool.replacements(len(lost), self.scaling.replace_timeout_s)
        decision = self.decide(world=len(ranks), lost=len(lost), replacements=len(got))
        logger.warning("raymesh.train: %s: %s", decision.action, decision.reason)
        if decision.action == "abort":
            for r in got:
                r.stop()
            raise TrainError(
                f"cannot heal: {decision.reason}", cause=None, history=self.log.history
            )
        places: list[Rank | None] = list(ranks)
        for i, r in zip(lost, got):
            places[i] = r
        for i in lost[len(got) :]:
            places[i] = None
        return [r for r in places if r is not None], set(got), decision

    def reform(self, ranks: list[Rank], *, fresh: set[Rank], source: Rank | None) -> None:
        """`reshape`, healing again when ranks are lost while the world re-forms, until the
        world forms or the failure policy gives up (TooManyFailures, TrainError)."""
        state = None
        while True:
            try:
                self.reshape(ranks, fresh=fresh, source=source, state=state)
                return
            except WorldBroken as broken:
                state = broken.state
                lost = sorted({x.rank for x in broken.lost})
                records = self.log.lost(broken.lost, self.step + 1)
                logger.warning(
                    "raymesh.train: lost while re-forming: %s", "; ".join(map(str, records))
                )
                if self.decide(world=len(ranks), lost=len(lost), replacements=len(lost)).action == (
                    "abort"
                ):
                    raise TooManyFailures(
                        self.log.failures, latest_checkpoint(self.checkpoint)
                    ) from None
                gone = {ranks[i] for i in lost}
                if source in gone:
                    source = None  # its state, if fetched, is `state`; else the checkpoint
                ranks, got, decision = self.replace_lost(ranks, lost)
                fresh = (fresh - gone) | got
                by = replaced_by(ranks, lost, decision)
                for r in records:
                    self.log.healed([r], r.time, 0, action=decision.action, replaced_by=by)

    def reshape(
        self,
        ranks: list[Rank],
        *,
        fresh: set[Rank],
        source: Rank | None,
        state: ReplicaState | None = None,
    ) -> None:
        """Make `ranks` the world (see the module docstring). Raises WorldBroken (naming the
        ranks, and carrying the DDP state it fetched) when a rank dies, or is stuck once
        another failed, while the world forms."""
        assert self.decision is not None and self.base is not None
        decision = self.base.resized(len(ranks))
        if decision.strategy != self.decision.strategy:
            logger.warning("raymesh.train: %s", decision.reason)
        self.decision = decision
        self._install(ranks, rejoin=True)
        rdv = self._rendezvous(ranks)
        if not decision.sharded and (source is not None or state is not None):
            if state is None:
                assert source is not None
                state = source.worker.get_state.call_one().get(timeout=self.failure.timeout_s)
            assert state is not None
            calls = []
            for i, r in enumerate(ranks):
                if r in fresh:
                    calls.append(
                        [
                            r.worker.setup.call_one(rdv[i], measure=False),
                            r.worker.prepare.call_one(decision, None),
                        ]
                    )
                else:
                    calls.append([r.worker.reform.call_one(rdv[i])])
            self.converge(calls, state)
            # Past the job's first step, the uninterrupted run's DDP has rebuilt its buckets:
            # the new one must reduce in the same layout (see parallelize.settle_buckets).
            settle = state.done > self.first_step
            self.converge([[r.worker.set_state.call_one(state, settle)] for r in ranks], state)
            self.step = state.done
        else:
            path = latest_checkpoint(self.checkpoint)
            if path is None:
                why = (
                    f"{decision.strategy.upper()} ranks hold only shards"
                    if source is not None
                    else "no rank survived"
                )
                raise TrainError(
                    f"cannot heal in place ({why}) and there is no checkpoint to heal from; set "
                    "checkpoint=CheckpointConfig(dir=..., every=N) so a lost rank can be restored",
                    cause=None,
                    history=self.log.history,
                )
            calls = [
                [
                    r.worker.setup.call_one(rdv[i], measure=False),
                    r.worker.prepare.call_one(decision, path),
                ]
                for i, r in enumerate(ranks)
            ]
            self.step = self.converge(calls, None)[0]
            # Steps after the checkpoint are trained again: their first rows are void.
            self.log.trim(self.step)
        self.pool.set_world(ranks)
        self.generation += 1

    def converge(self, calls: list[list[Any]], state: ReplicaState | None) -> list[Any]:
        """Wait for each rank's calls (calls[i]: rank i's, in order) and return each rank's
        last result. A rank that died, or that is still blocked `HEAL_GRACE_S` after another
        failed (in a rendezvous that cannot complete), breaks the world: WorldBroken. An error
        on a live rank is collateral when another rank was lost (a peer gone mid-rendezvous),
        else it is raised as it is."""
        results = settle([f for fs in calls for f in fs], self.failure.timeout_s)
        lost: list[LostRank] = []
        errors: list[BaseException] = []
        k = 0
        for i, fs in enumerate(calls):
            mine, k = results[k : k + len(fs)], k + len(fs)
            dead = [r for r in mine if isinstance(r, SupervisionError)]
            if dead:
                lost.append(LostRank(i, "died", dead[0].failure.cause))
            elif any(isinstance(r, TimeoutError) for r in mine):
                lost.append(LostRank(i, "stuck", "stuck joining the new world after a peer failed"))
            errors.extend(r for r in mine if isinstance(r, BaseException))
        if lost:
            raise WorldBroken(lost, state)
        if errors:
            raise errors[0]
        return [results[k - 1] for k in itertools.accumulate(len(fs) for fs in calls)]


def replaced_by(world: list[Rank], lost: list[int], decision: FailureDecision) -> dict[int, str]:
    """Which proc took each lost rank's place in the new `world` (replacements keep the lost
    ranks' places); empty when the world shrank instead."""
    if decision.action != "replace":
        return {}
    return {i: world[i].label() for i in lost}
