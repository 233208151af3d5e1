"""raymesh.serve's decisions as plain data: which requests leave together and when, when the
queue refuses one, and when the replica count changes (no Ray, no HTTP, no sleeping)."""

from __future__ import annotations

import pytest

from raymesh.serve import AutoscalePolicy, BatchConfig, BatchQueue, Overloaded, ReplicaScale


def _queue(**kw) -> BatchQueue[int]:
    return BatchQueue(BatchConfig(**({"max_batch_size": 4, "batch_wait_ms": 5.0} | kw)))


def test_a_full_batch_leaves_at_once_in_arrival_order_and_the_rest_waits():
    q = _queue()
    for i in range(6):
        q.put(i, now=10.0)
    assert q.ready(10.0)  # four are waiting: full, no need to wait
    assert q.take(10.0) == [0, 1, 2, 3]
    assert not q.ready(10.004)  # two left, their wait not over
    assert q.deadline() == pytest.approx(10.005)
    assert q.ready(10.005) and q.take(10.005) == [4, 5]
    assert len(q) == 0 and q.deadline() is None and not q.ready(99.0) and q.take(99.0) == []


def test_a_partial_batch_leaves_when_its_oldest_request_has_waited():
    q = _queue(batch_wait_ms=10.0)
    q.put("a", now=1.0)
    q.put("b", now=1.008)  # joins the batch of the oldest: the deadline is the oldest's
    assert not q.ready(1.009) and q.deadline() == pytest.approx(1.010)
    assert q.ready(1.010) and q.take(1.010) == ["a", "b"]
    zero = _queue(batch_wait_ms=0.0)  # no waiting: each request leaves as it comes
    assert not zero.ready(3.0)  # (an empty queue is never ready)
    zero.put("x", now=3.0)
    assert zero.ready(3.0) and zero.take(3.0) == ["x"]


def test_a_full_queue_refuses_with_a_retry_after_from_the_drain_rate():
    q = _queue(max_queue=8)
    for i in range(8):
        q.put(i, now=0.0)
    with pytest.raises(Overloaded) as first:
        q.put(8, now=0.0)
    assert first.value.depth == 8 and first.value.retry_after_s == 1  # no rate measured yet
    assert len(q) == 8  # the refused request changed nothing
    q.take(1.0)  # two batches leave at t=1: the drain rate is measured from the first
    q.take(1.0)
    for i in range(8):
        q.put(i, now=1.5)
    with pytest.raises(Overloaded) as later:
        q.put(99, now=3.0)  # 8 requests left in 2 s: 4 a second; 8 wait
    assert later.value.retry_after_s == 1  # half of them (4) drain in 1 s
    slow = _queue(max_queue=8)
    slow.put(0, now=0.0)
    slow.take(0.0)
    for i in range(8):
        slow.put(i, now=0.0)
    with pytest.raises(Overloaded) as slowly:
        slow.put(9, now=10.0)  # 1 request in 10 s: half of 8 takes 40 s
    assert slowly.value.retry_after_s == 40


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size=0: give an integer >= 1"),
        ({"max_batch_size": 2.5}, "max_batch_size=2.5"),
        ({"batch_wait_ms": -1}, "batch_wait_ms=-1: give a number of milliseconds >= 0"),
        ({"batch_wait_ms": float("nan")}, "batch_wait_ms=nan"),
        ({"max_queue": 0}, "max_queue=0"),
        ({"max_batch_size": 16, "max_queue": 8}, "must hold at least one full batch"),
    ],
)
def test_bad_batch_config_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BatchConfig(**kw)


def test_the_autoscaler_adds_on_queue_depth_or_latency_removes_when_idle_one_step_at_a_time():
    policy = AutoscalePolicy(min=1, max=3, queue_up=4, latency_up_s=0.05, cooldown_s=5)
    idle = dict(queue_depth=0, p99_s=0.01, busy_replicas=0.2, since_last_s=10)
    grow = policy.decide(replicas=1, **(idle | {"queue_depth": 9}))
    assert grow == ReplicaScale(2, grow.reason) and "9 requests waiting" in grow.reason
    slow = policy.decide(replicas=2, **(idle | {"p99_s": 0.2}))
    assert slow is not None and slow.replicas == 3 and "p99 200.0 ms > 50.0 ms" in slow.reason
    assert policy.decide(replicas=3, **(idle | {"queue_depth": 100})) is None  # at max
    assert policy.decide(replicas=1, **(idle | {"queue_depth": 9, "since_last_s": 1})) is None
    shrink = policy.decide(replicas=3, **idle)
    assert shrink is not None and shrink.replicas == 2 and "remove a replica" in shrink.reason
    busy = policy.decide(replicas=2, **(idle | {"busy_replicas": 1.8}))
    assert busy is None  # one replica would be 180% busy: stay
    assert policy.decide(replicas=1, **idle) is None  # at min
    assert policy.decide(replicas=2, **(idle | {"queue_depth": 1})) is None  # still has work


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"min": 0}, "replicas min=0"),
        ({"min": 3, "max": 2}, r"replicas=\(3, 2\): min must be <= max"),
        ({"queue_up": 0}, "queue_up=0: give a number > 0"),
        ({"latency_up_s": -1.0}, "latency_up_s=-1.0"),
        ({"busy_down": 1.5}, "busy_down=1.5: a share of the time"),
        ({"cooldown_s": -1}, "cooldown_s=-1"),
    ],
)
def test_bad_autoscale_policy_names_the_field(kw, message):
    with pytest.raises(ValueError, match=message):
        AutoscalePolicy(**kw)
