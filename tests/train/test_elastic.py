"""Healing that changes more than one rank: an FSDP rank lost (every rank rebuilds from the
checkpoint), an elastic FSDP job that starts with the room there is and grows (through a
checkpoint) when room appears, and elastic training on a multi-node local cluster (a node is
lost, the job shrinks to the ranks that fit, and grows back when a node joins)."""

from __future__ import annotations

import itertools
import logging
import textwrap
import time

import pytest

from raymesh import train
from raymesh.testing import kill
from raymesh.train.checkpoint import Manifest

from ..scripts import run_cluster_script
from ..waiting import wait_for
from .weights import MLP, close, equal

pytestmark = pytest.mark.timeout(300)


def _config(tmp_path, **kw) -> train.TrainConfig:
    base = dict(
        workers=2,
        steps=12,
        global_batch_size=48,
        seed=0,
        report_every=2,
        strategy="fsdp",
        checkpoint=train.CheckpointConfig(dir=str(tmp_path / "ckpt"), every=4),
    )
    base.update(kw)
    return train.TrainConfig(**base)


def test_a_killed_fsdp_rank_is_healed_from_the_newest_checkpoint(fit, tmp_path):
    clean = fit(MLP, _config(tmp_path / "clean"))
    result = fit(MLP, _config(tmp_path / "healed", faults=[kill(rank=1, at_step=6)]))
    [failure] = result.failures
    assert (failure.rank, failure.step, failure.kind) == (1, 6, "died")
    # Shards do not survive their rank: steps 5 and 6 are trained again from step 4's checkpoint.
    assert failure.steps_recomputed == 2
    assert [h["step"] for h in result.history][-1] == 12
    assert result.decision.strategy == "fsdp"
    # The same world reloads the checkpoint and reduces as before: bit for bit.
    assert equal(clean.state_dict(), result.state_dict())


@pytest.mark.usefixtures("ray_cluster")
def test_auto_picks_hsdp_when_a_shard_group_fits_and_a_killed_hsdp_rank_is_healed(tmp_path):
    four = dict(workers=4, shard_size=2)
    # The three jobs run in turn in the same procs (train.WarmRanks): the later ones build in
    # procs an earlier job trained in, and must see none of its state.
    warm = train.WarmRanks()
    ddp = train.fit(MLP, _config(tmp_path / "ddp", strategy="ddp", workers=4), warm=warm)
    est = ddp.decision.estimate
    between = (est.ddp_bytes() + est.fsdp_bytes(2)) / 2 / 0.8  # fits groups of 2, not DDP
    auto = _config(tmp_path / "auto", strategy="auto", memory_budget_gb=between / 2**30, **four)
    clean = train.fit(MLP, auto, warm=warm)
    assert clean.decision.strategy == "hsdp", clean.decision.reason
    assert clean.decision.shard_size == 2 and clean.decision.mesh(4) == (2, 2)
    assert "hsdp 2x2" in clean.decision.reason
    # Replicas reduce in another order than DDP's buckets: equal to float precision.
    assert close(ddp.state_dict(), clean.state_dict(), rtol=1e-4, atol=1e-6)

    forced = _config(tmp_path / "healed", strategy="hsdp", faults=[kill(rank=2, at_step=6)], **four)
    with warm:
        healed = train.fit(MLP, forced, warm=warm)
    assert warm.served == 8  # the second and third jobs started in the first one's procs
    # Rank 2's peers in its shard and replicate groups fail at once. Rank 1, blocked on them in
    # its own groups, cannot be freed (gloo closes a group only with its process) and is
    # replaced as a consequence, not counted as a failure.
    [failure] = [f for f in healed.failures if f.kind != "stuck"]
    assert (failure.rank, failure.kind, failure.steps_recomputed) == (2, "died", 2)
    assert {f.rank for f in healed.failures if f.kind == "stuck"} <= {1}
    assert healed.decision.strategy == "hsdp"
    assert equal(clean.state_dict(), healed.state_dict())


@pytest.mark.usefixtures("ray_cluster")
def test_an_fsdp_job_without_checkpoints_fails_with_a_clear_error(tmp_path):
    config = _config(tmp_path, checkpoint=None, faults=[kill(rank=1, at_step=3)])
    with pytest.raises(train.TrainError, match=r"no checkpoint to heal from.*CheckpointConfig"):
        train.fit(MLP, config)


def _leave_room_for(n: int) -> list:
    """Proc meshes holding all of this host's free CPUs but `n`, once Ray's view of them has
    settled (procs of an earlier test may still be giving theirs back)."""
    from raymesh.actor import host_mesh, this_host

    here = this_host()
    node = here.node_ids[0]
    blockers: list = []
    steady, deadline = 0, time.monotonic() + 60
    while steady < 5:  # exactly n free, five looks in a row (1 s)
        room = host_mesh().free_procs(cpus_per_proc=1.0)
        if set(room) - {node}:
            pytest.skip(f"needs a cluster of one host, not {room}")
        extra = room.get(node, 0) - n
        assert extra >= 0 and time.monotonic() < deadline, f"room for {n} procs: {room}"
        if extra:
            name = f"blocker-{len(blockers)}"
            blockers.append(here.spawn_procs(per_host={"procs": 1}, cpus_per_proc=extra, name=name))
        steady = 0 if extra else steady + 1
        time.sleep(0.2)
    return blockers


@pytest.mark.usefixtures("ray_cluster")
def test_an_elastic_fsdp_job_starts_with_the_room_there_is_and_grows_when_room_appears(
    tmp_path, caplog
):
    blockers = _leave_room_for(2)  # room for 2 of the job's 3 ranks
    run = tmp_path / "ckpt"
    config = _config(
        tmp_path,
        workers=(2, 3),
        replace_timeout_s=1.0,
        grow_interval_s=0.5,
        checkpoint=train.CheckpointConfig(dir=str(run), every=4, keep=5),
    )
    worlds: list[int] = []

    def recruited() -> bool:
        return any(r.getMessage() == "raymesh.train: recruited 1 rank(s)" for r in caplog.records)

    def progress(p: dict) -> None:
        worlds.append(p["world_size"])
        if p["step"] >= 4 and blockers:
            for b in blockers:  # room appears: hold the controller until a rank is recruited
                b.stop()
            blockers.clear()
            wait_for(recruited, 60, what="a rank recruited where the room appeared")

    try:
        with caplog.at_level(logging.INFO, logger="raymesh"):
            result = train.fit(MLP, config, progress=progress)
    finally:
        for b in blockers:
            b.stop()
    said = [r.getMessage() for r in caplog.records if r.name == "raymesh"]
    assert "raymesh.train: room for 2 of max 3 workers now: starting with 2" in said, said
    assert worlds[0] == 2 and worlds[-1] == 3, worlds
    states = [s for s, _ in result.transitions]
    assert states == ["Starting", "Running", "Resizing", "Running", "Finishing", "Finished"]
    assert result.transitions[2][1] == "capacity returned: 1 rank(s) ready, 2 -> 3 (max 3)"
    assert result.transitions[3][1] == "grew by 1: generation 1, 3 ranks"
    assert result.decision.strategy == "fsdp" and not result.failures
    assert [h["step"] for h in result.history] == list(range(1, 13))
    # The shards moved to the grown world through a checkpoint saved as it grew: every
    # checkpoint is FSDP's, those before the growth of 2 ranks, those after of 3.
    saved = [
        Manifest.from_json((p / "manifest.json").read_text()) for p in sorted(run.glob("step-*"))
    ]
    assert {m.strategy for m in saved} == {"fsdp"}
    sizes = [m.world_size for m in saved]
    assert sizes == sorted(sizes) and sizes[0] == 2 and sizes[-1] == 3, sizes
    clean = train.fit(MLP, _config(tmp_path / "clean", workers=3, checkpoint=None))
    assert close(clean.state_dict(), result.state_dict(), rtol=1e-4, atol=1e-6)


# Node loss on a real 3-node Ray cluster (head without CPUs, two 2-CPU nodes): 4 ranks, one per
# CPU. At step 20 (REMOVE_AT) one node is removed, taking 2 ranks with it; no node has room for
# replacements, so the job continues with 2 (min). Then a node joins, and the job grows back to
# 4. A sleep in the loss keeps the run long enough for that, and does not change the math: the
# weights must match a failure-free run at 4 ranks (allclose: the reductions ran at other world
# sizes in between).
ELASTIC = textwrap.dedent(
    """
    import dataclasses, json, time
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "_system_config": {"health_check_period_ms": 500, "health_check_failure_threshold": 3},
        },
    )
    cluster.add_node(num_cpus=2)
    doomed = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    import ray
    ray.init(address=cluster.address)
    import logging
    import torch
    from raymesh import train
    from raymesh.examples import mlp

    placing = []  # what the controller said about placement, to explain a failure
    shrunk = []  # the controller's shrink decisions
    recruited = []  # the recruiter's reports of ranks ready to join

    class Keep(logging.Handler):
        def emit(self, record):
            message = record.getMessage()
            if "placement" in message:
                placing.append(message[:300])
            if message.startswith("raymesh.train: shrink: "):
                shrunk.append(message[:300])
            if "recruited" in message:
                recruited.append(message[:300])

    logging.getLogger("raymesh").addHandler(Keep())
    # On stderr with the time, to show where a slow run spent it.
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)d %(name)s: %(message)s")
    logging.getLogger("raymesh").setLevel(logging.INFO)

    def slow(ctx):
        task = mlp.build(ctx)
        loss_fn = task.loss_fn
        def loss(model, batch):
            time.sleep(0.03)
            return loss_fn(model, batch)
        return dataclasses.replace(task, loss_fn=loss)

    config = train.TrainConfig(
        workers=(2, 4), steps=STEPS, global_batch_size=8, seed=0, report_every=4,
        replace_timeout_s=2.0, grow_interval_s=0.5, step_timeout_s=20.0,
    )
    # Where the 4 ranks would go: with room on two hosts, the topology planner orders them.
    from raymesh.train.control.placement import Placer

    planner = Placer(config.scaling, config.parallelism, gpus=False)
    planned = [planner.place(4), planner.reason]
    t0 = time.time()
    # The job starts in the clean run's procs (train.WarmRanks), 4 cold starts fewer: where
    # they are and what happens to them when the node goes are the same.
    warm = train.WarmRanks()
    clean = train.fit(mlp.build, dataclasses.replace(config, report_every=50), warm=warm)
    t1 = time.time()
    worlds, events = [], []

    def progress(p):
        worlds.append((p["step"], p["world_size"]))
        if p["step"] >= REMOVE_AT and not events:
            events.append("removed")
            cluster.remove_node(doomed, allow_graceful=False)
        # The node joins only once the job has shrunk: joining while the heal still waits
        # for room (replace_timeout_s) lets it replace the lost ranks instead (a failed run on
        # a loaded machine reported 2 ranks and healed to 4 without shrinking).
        elif events == ["removed"] and shrunk and p["world_size"] == 2:
            events.append("added")
            recruited.clear()
            cluster.add_node(num_cpus=2)
            # Hold the controller until the recruiter has ranks ready on the new node (the
            # ranks finish their queued chunks and wait), so the job grows within a few steps
            # however slow the machine, and the run can stay short.
            deadline = time.time() + 120
            while not recruited and time.time() < deadline:
                time.sleep(0.2)

    result = train.fit(slow, config, progress=progress, warm=warm)
    served = warm.served
    warm.close()
    a, b = clean.state_dict(), result.state_dict()
    differ = [  # by name: a missing or extra tensor shows in the keys
        k for k in sorted(set(a) & set(b)) if not torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-6)
    ]
    print("RESULT", json.dumps({
        "events": events,
        "worlds": worlds,
        "transitions": result.transitions,
        "failures": [[f.rank, f.kind, f.cause] for f in result.failures],
        "steps": [h["step"] for h in result.history],
        "keys": [sorted(a), sorted(b)],
        "differ": differ,
        "planned": planned,
        "placing": placing,
        "seconds": [t1 - t0, time.time() - t1],
        "served": served,
    }))
    ray.shutdown()
    cluster.shutdown()
    """
)


def test_node_loss_shrinks_to_what_fits_and_a_new_node_grows_it_back(tmp_path):
    steps = 120
    script = ELASTIC.replace("STEPS", str(steps)).replace("REMOVE_AT", "20")
    got = run_cluster_script(tmp_path / "elastic.py", script, timeout=280)
    assert got["events"] == ["removed", "added"], got
    worlds = [w for _, w in got["worlds"]]
    assert worlds[0] == 4 and 2 in worlds and worlds[-1] == 4, got["worlds"]
    states = [s for s, _ in got["transitions"]]
    assert "Healing" in states and "Resizing" in states, got["transitions"]
    assert any("shrink" in reason for _, reason in got["transitions"]), got["transitions"]
    assert len(got["failures"]) == 2 and {f[1] for f in got["failures"]} <= {
        "died",
        "hung",
        "stuck",
    }
    assert got["steps"] == list(range(1, steps + 1))
    assert got["served"] == 4, got  # the job started in the clean run's procs
    clean_keys, keys = got["keys"]
    assert clean_keys and keys == clean_keys, "the tensors differ from the failure-free run's"
    assert got["differ"] == [], "these weights differ from the failure-free run's"
    nodes, reason = got["planned"]
    assert reason and "ddp on 4 CPU procs of 2 host(s)" in reason, got["placing"]
    # Two ranks per host, each host's ranks next to each other (one cross-host hop in the ring).
    assert len(set(nodes)) == 2 and sum(a != b for a, b in itertools.pairwise(nodes)) == 1, nodes
