"""Channels on real procs: a Port sent to actors and sent on many times, read by the
PortReceiver in the controller (mailbox on a proc of its own) or in an actor (its process's
own mailbox); order per sender, errors, once-ports, timeouts; Monarch's `send` to a port."""

from __future__ import annotations

import pickle

import pytest

from raymesh import ActorError, Channel, send, this_host

from .monarch_actors import Producer, Squarer

pytestmark = pytest.mark.usefixtures("ray_cluster")


@pytest.fixture(scope="module")
def procs():
    procs = this_host().spawn_procs(per_host={"procs": 2}, name="channels")
    yield procs
    procs.stop()


@pytest.fixture(scope="module")
def producers(procs):
    return procs.spawn("producers", Producer)


@pytest.mark.timeout(60)
def test_the_controller_receives_what_each_actor_sends_in_the_order_it_sent(producers):
    port, receiver = Channel[int].open_ranked()
    producers.produce.call(port, 20).get(timeout=30)
    got = [receiver.recv().get(timeout=10) for _ in range(40)]
    for rank in (0, 1):
        assert [v for r, v in got if r == rank] == [rank * 10 + s for s in range(20)]


@pytest.mark.timeout(60)
def test_an_actor_opens_a_channel_and_fans_its_producers_in(procs, producers):
    # (a mesh of its own: a producer's turn would be held by collect while it waits)
    coordinator = procs.slice(procs=0).spawn("coordinator", Producer)
    got = coordinator.collect.call_one(producers, 3).get(timeout=30)
    assert got == [0, 1, 2, 10, 11, 12]


@pytest.mark.timeout(60)
def test_an_exception_sent_on_a_port_raises_from_recv_and_the_channel_goes_on(producers):
    port, receiver = Channel[int].open()
    first = producers.slice(procs=1)
    first.fail.call_one(port).get(timeout=10)
    first.produce.call_one(port, 1).get(timeout=10)
    with pytest.raises(ActorError, match="no data") as info:
        receiver.recv().get(timeout=10)
    assert info.value.remote_type == "ValueError" and info.value.rank == 1
    assert receiver.recv().get(timeout=10) == 10


@pytest.mark.timeout(60)
def test_receives_made_before_the_values_resolve_in_order_and_time_out_when_none_come(producers):
    port, receiver = Channel[int].open()
    pending = [receiver.recv() for _ in range(3)]
    with pytest.raises(TimeoutError):
        pending[0].get(timeout=0.3)
    producers.slice(procs=0).produce.call_one(port, 3).get(timeout=10)
    assert [f.get(timeout=10) for f in pending] == [0, 1, 2]


@pytest.mark.timeout(60)
def test_a_once_port_sends_one_value_and_a_receiver_stays_where_it_was_opened(producers):
    port, receiver = Channel[int].open(once=True)
    port.send(7)
    with pytest.raises(RuntimeError, match="one value"):
        port.send(8)
    assert receiver.recv().get(timeout=10) == 7
    with pytest.raises(TypeError, match="send the Port instead"):
        pickle.dumps(receiver)


@pytest.fixture(scope="module")
def squarers(procs):
    return procs.spawn("squarers", Squarer)


@pytest.mark.timeout(60)
def test_send_puts_every_actors_reply_on_the_port_and_errors_raise_from_recv(squarers):
    port, receiver = Channel[int].open()
    send(squarers.square, (3,), {}, port)
    assert sorted(receiver.recv().get(timeout=10) for _ in range(2)) == [9, 10]
    send(squarers.square, (-1,), {}, port, selection="choose")
    with pytest.raises(ActorError, match="-1 is negative"):
        receiver.recv().get(timeout=10)
    with pytest.raises(TimeoutError):  # "choose" sent to one actor: nothing else comes
        receiver.recv().get(timeout=0.5)


@pytest.mark.timeout(60)
def test_send_without_a_port_is_a_broadcast_in_the_callers_order(procs):
    fresh = procs.spawn("squarers-no-port", Squarer)
    for x in range(5):
        send(fresh.square, (x,), {})
    assert fresh.history.call().get(timeout=10).values() == [[0, 1, 2, 3, 4]] * 2
    with pytest.raises(ValueError, match=r"selection='some'.*'all' or 'choose'"):
        send(fresh.square, (1,), {}, selection="some")
