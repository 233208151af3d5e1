"""Unit tests for `raymesh.train.strategy` and `choice`: the DDP/HSDP/FSDP decision, from made-up
numbers."""

from __future__ import annotations

import pytest

from raymesh.train.choice import Figures, Verdict, judge
from raymesh.train.estimate import MemoryEstimate
from raymesh.train.strategy import StrategyPolicy, host_shard_size, splits_into_shard_groups

GIB = 1 << 30
MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# StrategyPolicy.decide
# ---------------------------------------------------------------------------------------------

# 1 GiB replicated (0.25 params + 0.25 grads + 0.5 AdamW), 0.25 GiB per rank over 4 ranks
ONE_GIB = MemoryEstimate(GIB // 4, GIB // 4, GIB // 2, activation_bytes=0)


def test_auto_picks_ddp_when_it_fits_and_the_reason_shows_the_arithmetic():
    d = StrategyPolicy().decide("auto", ONE_GIB, world_size=4, budget_bytes=16 * GIB)
    assert d.strategy == "ddp"
    assert d.reason == (
        "ddp: 1.00 GiB per rank (params 0.25 + grads 0.25 + optimizer 0.50 + activations 0.00)"
        " fits 80% of the 16.00 GiB budget (12.80 GiB)"
    )
    assert (d.estimate, d.budget_bytes) == (ONE_GIB, 16 * GIB)


def test_auto_picks_fsdp_when_the_budget_is_below_ddp_but_above_the_shard():
    d = StrategyPolicy().decide("auto", ONE_GIB, world_size=4, budget_bytes=GIB)
    assert d.strategy == "fsdp"
    assert d.reason == (
        "fsdp: 0.25 GiB per rank ((params 0.25 + grads 0.25 + optimizer 0.50 = 1.00) / 4 ranks"
        " + largest block 0.00 + activations 0.00) fits 80% of the 1.00 GiB budget (0.80 GiB);"
        " ddp would need 1.00 GiB"
    )


def test_auto_raises_with_the_numbers_and_fixes_when_too_big_even_sharded():
    big = MemoryEstimate(GIB, GIB, 2 * GIB, activation_bytes=GIB // 4, largest_block_bytes=GIB)
    with pytest.raises(ValueError) as info:
        StrategyPolicy().decide("auto", big, world_size=2, budget_bytes=2 * GIB)
    msg = str(info.value)
    assert "does not fit in memory even sharded" in msg
    assert "4.25 GiB per rank (params 1.00 + grads 1.00 + optimizer 2.00" in msg  # ddp
    assert "3.25 GiB per rank ((params 1.00 + grads 1.00 + optimizer 2.00 = 4.00) / 2" in msg
    assert "per-rank budget of 2.00 GiB" in msg
    assert "use at least 12 workers (now 2)" in msg  # 4 / (0.8 * 2 - 1 - 0.25) = 11.4
    assert "give each rank at least 4.07 GiB" in msg  # 3.25 / 0.8


def test_auto_raises_when_over_the_headroom_and_suggests_workers_or_forcing():
    # ddp 1 GiB, fsdp over 2 ranks 0.5 GiB: the 600 MiB budget holds fsdp but not 80% of it
    with pytest.raises(ValueError) as info:
        StrategyPolicy().decide("auto", ONE_GIB, world_size=2, budget_bytes=600 * MIB)
    msg = str(info.value)
    assert "does not fit 80% of the 600.00 MiB budget (480.00 MiB)" in msg
    assert "use at least 3 workers (now 2)" in msg
    assert "force strategy='fsdp'" in msg


def test_forced_fsdp_is_honoured_even_when_ddp_fits():
    d = StrategyPolicy().decide("fsdp", ONE_GIB, world_size=4, budget_bytes=16 * GIB)
    assert d.strategy == "fsdp"
    assert d.reason.startswith("fsdp: 0.25 GiB per rank")
    assert "fits 80%" in d.reason


def test_forced_ddp_over_the_headroom_says_so_but_does_not_raise():
    d = StrategyPolicy().decide("ddp", ONE_GIB, world_size=4, budget_bytes=1200 * MIB)
    assert d.strategy == "ddp"
    assert "exceeds 80% of the 1.17 GiB budget" in d.reason
    assert "forced by strategy='ddp'" in d.reason


def test_forced_ddp_over_the_whole_budget_warns_of_out_of_memory_when_fsdp_would_fit():
    d = StrategyPolicy().decide("ddp", ONE_GIB, world_size=4, budget_bytes=GIB // 2)
    assert d.strategy == "ddp"
    assert "exceeds the whole 512.00 MiB budget" in d.reason
    assert "expect out-of-memory" in d.reason


@pytest.mark.parametrize("requested", ["ddp", "fsdp"])
def test_forced_choices_still_fail_before_training_when_nothing_fits(requested):
    with pytest.raises(ValueError, match="does not fit in memory even sharded"):
        StrategyPolicy().decide(requested, ONE_GIB, world_size=4, budget_bytes=100 * MIB)


def test_ddp_fits_at_exactly_80_percent_of_the_budget_and_not_a_byte_below():
    # ddp needs 1 GiB = 1024 MiB; 80% of 1280 MiB is exactly that. One byte less of budget and
    # 80% of it falls short, so auto shards instead (FSDP over 4: 0.25 GiB per rank).
    at = StrategyPolicy().decide("auto", ONE_GIB, world_size=4, budget_bytes=1280 * MIB)
    assert at.strategy == "ddp", at.reason
    assert at.reason.endswith("fits 80% of the 1.25 GiB budget (1.00 GiB)"), at.reason
    below = StrategyPolicy().decide("auto", ONE_GIB, world_size=4, budget_bytes=1280 * MIB - 1)
    assert below.strategy == "fsdp", below.reason


def test_headroom_is_configurable():
    assert StrategyPolicy(headroom=1.0).decide("auto", ONE_GIB, 1, GIB).strategy == "ddp"
    assert "fits 100%" in StrategyPolicy(headroom=1.0).decide("auto", ONE_GIB, 1, GIB).reason
    # half of 2 GiB holds the 1 GiB ddp needs; half of a byte less does not
    assert StrategyPolicy(headroom=0.5).decide("auto", ONE_GIB, 4, 2 * GIB).strategy == "ddp"
    assert StrategyPolicy(headroom=0.5).decide("auto", ONE_GIB, 4, 2 * GIB - 1).strategy == "fsdp"
    # and 80% of 1229 MiB (983.2 MiB) is short of it though 100% of it is not
    assert StrategyPolicy().decide("auto", ONE_GIB, 4, 1229 * MIB).strategy == "fsdp"
    assert StrategyPolicy(headroom=1.0).decide("auto", ONE_GIB, 4, 1229 * MIB).strategy == "ddp"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"requested": "zero3"}, "strategy='zero3'"),
        ({"world_size": 0}, "world_size=0"),
        ({"budget_bytes": 0}, "budget_bytes=0"),
    ],
)
def test_decide_rejects_bad_arguments_naming_them(kwargs, match):
    args = {"requested": "auto", "estimate": ONE_GIB, "world_size": 1, "budget_bytes": GIB}
    with pytest.raises(ValueError, match=match):
        StrategyPolicy().decide(**{**args, **kwargs})


# HSDP over 2 hosts x 2 ranks: shard groups of 2 hold 0.5 GiB per rank, FSDP over 4 0.25 GiB.


def test_auto_picks_hsdp_over_fsdp_when_a_shard_group_fits_and_ddp_does_not():
    d = StrategyPolicy().decide("auto", ONE_GIB, world_size=4, budget_bytes=GIB, shard_size=2)
    assert (d.strategy, d.shard_size, d.mesh(4)) == ("hsdp", 2, (2, 2))
    assert d.sharded
    assert d.reason == (
        "hsdp 2x2 (sharded within groups of 2, replicated across 2): 0.50 GiB per rank ((params"
        " 0.25 + grads 0.25 + optimizer 0.50 = 1.00) / 2 ranks + largest block 0.00 + activations"
        " 0.00) fits 80% of the 1.00 GiB budget (0.80 GiB); ddp would need 1.00 GiB"
    )


def test_auto_still_picks_ddp_when_it_fits_with_shard_groups_on_offer():
    d = StrategyPolicy().decide("auto", ONE_GIB, world_size=4, budget_bytes=16 * GIB, shard_size=2)
    assert d.strategy == "ddp" and d.shard_size is None and d.mesh(4) is None


def test_auto_falls_back_to_fsdp_when_a_shard_group_is_too_small_and_says_so():
    d = StrategyPolicy().decide("auto", ONE_GIB, world_size=4, budget_bytes=600 * MIB, shard_size=2)
    assert d.strategy == "fsdp"
    assert "hsdp over groups of 2 0.50 GiB" in d.reason


def test_the_planners_estimate_chooses_between_hsdp_and_fsdp_and_is_in_the_reason():
    comm = {"ddp": 0.020, "fsdp": 0.030, "hsdp": 0.012}
    d = StrategyPolicy().decide("auto", ONE_GIB, 4, GIB, shard_size=2, comm=comm)
    assert d.strategy == "hsdp"
    assert d.reason.endswith("estimated communication 12 ms per step (vs ddp 20 ms, fsdp 30 ms)")
    cheaper_fsdp = {"ddp": 0.020, "fsdp": 0.010, "hsdp": 0.012}
    d = StrategyPolicy().decide("auto", ONE_GIB, 4, GIB, shard_size=2, comm=cheaper_fsdp)
    assert d.strategy == "fsdp"


def test_forced_hsdp_needs_shard_groups_and_names_the_fix():
    with pytest.raises(ValueError, match="no shard groups: set shard_size"):
        StrategyPolicy().decide("hsdp", ONE_GIB, world_size=4, budget_bytes=16 * GIB)
    d = StrategyPolicy().decide("hsdp", ONE_GIB, 4, 16 * GIB, shard_size=2)
    assert d.strategy == "hsdp" and "fits 80%" in d.reason


@pytest.mark.parametrize("shard_size", [1, 3, 4])
def test_shard_groups_must_split_the_world_in_two_or_more(shard_size):
    with pytest.raises(ValueError, match=f"shard_size={shard_size}: HSDP needs"):
        StrategyPolicy().decide("auto", ONE_GIB, 4, GIB, shard_size=shard_size)


def test_hsdp_resized_keeps_whole_shard_groups_else_becomes_fsdp():
    d = StrategyPolicy().decide("hsdp", ONE_GIB, 8, 16 * GIB, shard_size=2)
    assert d.resized(6).mesh(6) == (3, 2)
    three = d.resized(3)
    assert three.strategy == "fsdp" and three.shard_size is None and three.mesh(3) is None
    assert "no longer splits into shard groups of 2" in three.reason
    assert d.resized(2).strategy == "fsdp"  # one group is FSDP
    ddp = StrategyPolicy().decide("auto", ONE_GIB, 4, 16 * GIB)
    assert ddp.resized(3) is ddp


@pytest.mark.parametrize(
    ("nodes", "size"),
    [
        (["a", "a", "b", "b"], 2),
        (["a", "a", "a", "b", "b", "b"], 3),
        (["a", "a", "a", "a"], None),  # one host
        (["a", "a", "a", "b"], None),  # uneven
        (["a", "b", "a", "b"], None),  # a host's ranks not together
        (["a", "b", "c"], None),  # one rank per host: that is DDP
    ],
)
def test_host_shard_size_is_one_hosts_ranks_when_they_fill_hosts_evenly(nodes, size):
    assert host_shard_size(nodes) == size


@pytest.mark.parametrize(
    ("world_size", "shard_size", "splits"),
    [
        (4, 2, True),
        (6, 3, True),
        (4, 4, False),  # one group: that is FSDP
        (4, 1, False),  # groups of one rank: that is DDP
        (6, 4, False),  # not whole groups
    ],
)
def test_splits_into_shard_groups_needs_two_or_more_whole_groups_of_two_or_more(
    world_size, shard_size, splits
):
    assert splits_into_shard_groups(world_size, shard_size) is splits


def test_hsdp_mesh_refuses_a_world_that_is_not_whole_shard_groups():
    d = StrategyPolicy().decide("hsdp", ONE_GIB, 4, 16 * GIB, shard_size=2)
    with pytest.raises(ValueError, match="world_size 5 is not a multiple of shard_size 2"):
        d.mesh(5)


@pytest.mark.parametrize("headroom", [0.0, 1.5])
def test_policy_rejects_a_headroom_outside_zero_to_one(headroom):
    with pytest.raises(ValueError, match="headroom"):
        StrategyPolicy(headroom=headroom)


def test_too_big_a_block_says_more_workers_cannot_help():
    e = MemoryEstimate(GIB, GIB, 2 * GIB, activation_bytes=0, largest_block_bytes=GIB)
    with pytest.raises(ValueError, match="more workers cannot help"):
        StrategyPolicy().decide("auto", e, world_size=8, budget_bytes=GIB)


# ---------------------------------------------------------------------------------------------
# Activation checkpointing and offload, chosen with the sharding
# ---------------------------------------------------------------------------------------------

# 1 GiB of state and 2 GiB of activations, 0.25 GiB with each block checkpointed.
ACTIVE = MemoryEstimate(
    GIB // 4,
    GIB // 4,
    GIB // 2,
    activation_bytes=2 * GIB,
    largest_block_bytes=GIB // 8,
    checkpointed_activation_bytes=GIB // 4,
)


def test_auto_checkpoints_activations_only_when_no_sharding_fits_without():
    policy = StrategyPolicy()
    roomy = policy.decide("auto", ACTIVE, 4, 8 * GIB, checkpointing="auto")
    assert (roomy.strategy, roomy.checkpointing) == ("ddp", False)
    # 2.9 GiB: ddp 3 GiB and fsdp 2.375 GiB over 4 do not fit 80% of it (2.32 GiB); ddp with
    # checkpointing (1.25 GiB) does.
    tight = policy.decide("auto", ACTIVE, 4, int(2.9 * GIB), checkpointing="auto")
    assert (tight.strategy, tight.checkpointing, tight.offload) == ("ddp", True, False)
    assert "activation checkpointing per block (activations 2.00 GiB -> 0.25 GiB)" in tight.reason
    assert tight.estimate.activation_bytes == GIB // 4
    # Sharding that fits without checkpointing comes first (no recompute).
    sharded = policy.decide("auto", ACTIVE, 4, int(3.2 * GIB), checkpointing="auto")
    assert (sharded.strategy, sharded.checkpointing) == ("fsdp", False)


def test_checkpointing_and_offload_are_the_users_when_fixed():
    policy = StrategyPolicy()
    forced = policy.decide("auto", ACTIVE, 4, 8 * GIB, checkpointing=True)
    assert (forced.strategy, forced.checkpointing) == ("ddp", True)
    off = policy.decide("auto", ACTIVE, 4, 3 * GIB, checkpointing=False)
    assert (off.strategy, off.checkpointing) == ("fsdp", False)  # the sharding that fits
    with pytest.raises(ValueError, match="no blocks to checkpoint"):
        policy.decide("auto", ONE_GIB, 4, GIB, checkpointing=True)


def test_offload_is_the_last_resort_and_only_for_sharded_strategies():
    # 0.6 GiB: nothing fits on the device, even checkpointed (fsdp 0.25 + 0.125 + 0.25 GiB =
    # 0.625 GiB); offloaded, the device holds one block and the activations.
    d = StrategyPolicy().decide(
        "auto", ACTIVE, 4, int(0.6 * GIB), checkpointing="auto", offload="auto"
    )
    assert (d.strategy, d.checkpointing, d.offload) == ("fsdp", True, True)
    assert d.estimate.host_bytes == GIB and d.estimate.param_bytes == 0
    assert "offload: 1.00 GiB of state in host memory" in d.reason
    with pytest.raises(ValueError, match="offload=True needs a sharded strategy"):
        StrategyPolicy().decide("ddp", ACTIVE, 4, GIB, offload=True)


def test_when_nothing_fits_the_error_says_what_was_tried_and_what_the_user_could_change():
    with pytest.raises(ValueError) as info:
        StrategyPolicy().decide("auto", ACTIVE, 2, GIB // 2, checkpointing="auto")
    msg = str(info.value)
    # The numbers are the least memory it tried: with the blocks checkpointed.
    assert msg.startswith("with activation checkpointing, the job does not fit"), msg
    assert "activations 0.25" in msg
    assert "use at least" in msg and "workers (now 2)" in msg
    assert "precision='bf16' would need about" in msg
    assert "LoRA (a frozen base, small adapters) would need about" in msg


# ---------------------------------------------------------------------------------------------
# judge: the decision as data, before any words
# ---------------------------------------------------------------------------------------------


def _figures(
    world_size: int, budget: int, shard_size: int | None = None, comm: dict | None = None
) -> Figures:
    return Figures.of(
        ONE_GIB,
        world_size,
        budget,
        headroom=0.8,
        shard_size=shard_size,
        comm=comm,
        checkpointing=False,
        offload=False,
    )


def test_judge_returns_the_choice_and_what_auto_passed_over():
    # ddp 1 GiB; hsdp over groups of 2: 0.5 GiB; fsdp over 4: 0.25 GiB; limit 0.8 x budget.
    assert judge("auto", _figures(4, 2 * GIB, 2), must_fit=True) == Verdict(
        fit="fits", strategy="ddp"
    )
    assert judge("auto", _figures(4, GIB, 2), must_fit=True) == Verdict(
        fit="fits", strategy="hsdp", passed_over=("ddp",)
    )
    assert judge("auto", _figures(4, 600 * MIB, 2), must_fit=True) == Verdict(
        fit="fits", strategy="fsdp", passed_over=("ddp", "hsdp")
    )
    cheaper_fsdp = _figures(4, GIB, 2, comm={"hsdp": 0.02, "fsdp": 0.01})
    assert judge("auto", cheaper_fsdp, must_fit=True) == Verdict(
        fit="fits", strategy="fsdp", passed_over=("ddp",)
    )
    assert judge("auto", _figures(2, 600 * MIB), must_fit=True) == Verdict(
        fit="no_fit", strategy=None, passed_over=("ddp", "fsdp")
    )


def test_judge_takes_a_forced_strategy_over_the_limit_unless_it_must_fit():
    over_headroom = _figures(4, 1200 * MIB)  # ddp's 1 GiB: over 960 MiB, under 1200 MiB
    assert judge("ddp", over_headroom, must_fit=False).fit == "over_headroom"
    assert judge("ddp", over_headroom, must_fit=True).fit == "no_fit"
    assert judge("ddp", _figures(4, GIB // 2), must_fit=False).fit == "over_budget"
    assert judge("fsdp", _figures(4, GIB), must_fit=True) == Verdict(fit="fits", strategy="fsdp")
    # Over the whole budget under every strategy: whatever was asked.
    assert judge("ddp", _figures(2, 100 * MIB), must_fit=False) == Verdict(
        fit="too_big", strategy="ddp"
    )


@pytest.mark.parametrize(
    ("free", "strategy", "plans"),
    [
        ({"a": 1, "b": 1, "c": 1, "d": 1}, "auto", False),  # all the room, one rank a host
        ({"a": 2, "b": 2}, "ddp", False),  # all the room, nothing to weigh
        ({"a": 2, "b": 2}, "auto", True),  # HSDP's shard groups of 2 to weigh
        ({"a": 2, "b": 2}, "hsdp", True),
        ({"a": 3, "b": 3}, "ddp", True),  # places to choose: 4 of 6
        ({"a": 1, "b": 1}, "ddp", False),  # less room than ranks (an elastic start)
    ],
)
def test_cpu_ranks_are_planned_only_where_a_plan_could_change_something(free, strategy, plans):
    from raymesh import train
    from raymesh.train.control.placement import Placer

    config = train.TrainConfig(workers=(2, 4), global_batch_size=8, strategy=strategy)
    placer = Placer(config.scaling, config.parallelism, gpus=False)
    assert placer._choice(4, free) is plans
