"""Unit tests for `raymesh._src.endpoint` and the typed failures of `raymesh._src.errors`."""

from __future__ import annotations

import inspect
import pickle
import signal

import pytest

from raymesh._src.endpoint import Endpoint, endpoint, endpoint_names
from raymesh._src.errors import ActorError, MeshFailure, RemoteFailure, SupervisionError

# ---------------------------------------------------------------------------------------------
# @endpoint and endpoint_names
# ---------------------------------------------------------------------------------------------


class Counter:
    def __init__(self) -> None:
        self.value = 0

    @endpoint
    def incr(self, n: int = 1) -> int:
        """Add n and return the new value."""
        self.value += n
        return self.value

    @endpoint
    async def aget(self) -> int:
        return self.value

    def helper(self) -> str:
        return "plain"


class LoudCounter(Counter):
    @endpoint
    def shout(self) -> str:
        return "LOUD"


class PlainIncr(Counter):
    def incr(self, n: int = 1) -> int:  # a plain override: no longer an endpoint
        return -n


class ReEndpointed(PlainIncr):
    @endpoint
    def incr(self, n: int = 1) -> int:
        return n * 10


def test_endpoint_names_finds_the_decorated_methods():
    assert endpoint_names(Counter) == frozenset({"incr", "aget"})


def test_endpoint_names_does_not_include_plain_methods():
    assert "helper" not in endpoint_names(Counter)
    assert "__init__" not in endpoint_names(Counter)


def test_endpoint_names_includes_inherited_endpoints():
    assert endpoint_names(LoudCounter) == frozenset({"incr", "aget", "shout"})


def test_override_by_a_plain_method_removes_the_endpoint():
    assert endpoint_names(PlainIncr) == frozenset({"aget"})


def test_a_subclass_may_make_a_plain_override_an_endpoint_again():
    assert endpoint_names(ReEndpointed) == frozenset({"incr", "aget"})


def test_endpoint_names_follows_the_mro_of_multiple_inheritance():
    class Left:
        @endpoint
        def ping(self) -> str:
            return "left"

    class Right:
        def ping(self) -> str:
            return "right"

    class LeftFirst(Left, Right):
        pass

    class RightFirst(Right, Left):
        pass

    assert endpoint_names(LeftFirst) == frozenset({"ping"})
    assert endpoint_names(RightFirst) == frozenset()


def test_endpoint_names_of_a_class_with_none_is_empty():
    class Nothing:
        def plain(self) -> None:
            pass

    assert endpoint_names(Nothing) == frozenset()


def test_endpoint_names_returns_a_frozenset():
    assert isinstance(endpoint_names(Counter), frozenset)


def test_endpoint_detects_async_methods():
    assert Counter.aget.is_async is True
    assert Counter.incr.is_async is False


def test_descriptor_on_the_class_returns_the_endpoint():
    ep = Counter.incr
    assert isinstance(ep, Endpoint)
    assert ep.name == "incr"
    assert repr(ep) == "<endpoint incr>"


def test_descriptor_on_an_instance_returns_a_bound_method():
    counter = Counter()
    bound = counter.incr
    assert inspect.ismethod(bound)
    assert bound.__self__ is counter
    assert bound(2) == 2
    assert counter.incr(3) == 5
    assert counter.value == 5


def test_async_endpoint_on_an_instance_returns_a_coroutine_function():
    import asyncio

    counter = Counter()
    counter.incr(4)
    assert inspect.iscoroutinefunction(counter.aget)
    assert asyncio.run(counter.aget()) == 4


def test_endpoint_keeps_the_docstring_and_wrapped_function():
    ep = Counter.incr
    assert ep.__doc__ == "Add n and return the new value."
    assert ep.__wrapped__ is ep.fn
    assert ep.fn.__name__ == "incr"


def test_endpoint_name_is_the_attribute_name_it_is_assigned_to():
    def impl(self) -> int:
        return 1

    class Aliased:
        public = endpoint(impl)

    assert Aliased.public.name == "public"
    assert endpoint_names(Aliased) == frozenset({"public"})


def test_decorating_an_endpoint_twice_returns_the_same_endpoint():
    ep = Counter.incr
    assert endpoint(ep) is ep


def test_decorating_something_not_callable_raises_type_error():
    with pytest.raises(TypeError, match="decorates methods, not int"):
        endpoint(3)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------


class Boom(Exception):
    pass


def _actor_error() -> ActorError:
    return ActorError(
        mesh_name="trainers",
        rank=3,
        endpoint="step",
        remote_type="ValueError",
        remote_message="bad batch",
        remote_traceback="Traceback (most recent call last):\n  ...\nValueError: bad batch\n",
    )


def test_actor_error_message_names_the_endpoint_mesh_rank_and_remote_error():
    message = str(_actor_error())
    assert "Actor call trainers.step failed at rank 3: ValueError: bad batch" in message
    assert "Remote traceback:" in message
    assert "ValueError: bad batch\n" in message


def test_actor_error_survives_a_pickle_round_trip_with_its_attributes():
    err = _actor_error()
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is ActorError
    for attr in (
        "mesh_name",
        "rank",
        "endpoint",
        "remote_type",
        "remote_message",
        "remote_traceback",
    ):
        assert getattr(copy, attr) == getattr(err, attr)
    assert str(copy) == str(err)
    assert copy.args == err.args


def test_actor_error_that_was_raised_survives_a_pickle_round_trip():
    try:
        raise _actor_error()
    except ActorError as exc:
        copy = pickle.loads(pickle.dumps(exc))
    assert copy.rank == 3
    assert copy.remote_message == "bad batch"


def test_actor_error_is_a_runtime_error():
    assert isinstance(_actor_error(), RuntimeError)


def _failure(**kw) -> MeshFailure:
    defaults = dict(mesh_name="workers", ranks=(1, 2), kind="proc_died", cause="killed")
    defaults.update(kw)
    return MeshFailure(**defaults)


def test_mesh_failure_signal_name_of_9_is_sigkill():
    assert _failure(signal=9).signal_name == "SIGKILL"


def test_mesh_failure_signal_name_uses_the_platform_signal_names():
    assert _failure(signal=int(signal.SIGTERM)).signal_name == "SIGTERM"


def test_mesh_failure_signal_name_is_none_without_a_signal():
    assert _failure().signal_name is None


def test_mesh_failure_signal_name_of_an_unknown_signal_is_descriptive():
    assert _failure(signal=9999).signal_name == "signal 9999"


def test_mesh_failure_str_names_the_mesh_ranks_cause_and_child():
    child = _failure(mesh_name="inner", ranks=(0,), cause="exit code 1")
    parent = _failure(kind="child_failed", cause="child mesh failed", child=child)
    assert (
        str(child)
        == "MeshFailure(mesh_name=inner, crashed_ranks=[0], event=proc_died: exit code 1)"
    )
    assert str(parent) == (
        "MeshFailure(mesh_name=workers, crashed_ranks=[1, 2], event=child_failed: child mesh "
        "failed) <- MeshFailure(mesh_name=inner, crashed_ranks=[0], event=proc_died: exit code 1)"
    )


def test_mesh_failure_survives_pickle_with_a_nested_child():
    failure = _failure(kind="child_failed", child=_failure(signal=9), exit_code=None)
    copy = pickle.loads(pickle.dumps(failure))
    assert copy == failure
    assert copy.child is not None
    assert copy.child.signal_name == "SIGKILL"


def test_supervision_error_survives_a_pickle_round_trip_with_its_failure():
    failure = _failure(signal=9, exit_code=None)
    err = SupervisionError(failure)
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is SupervisionError
    assert copy.failure == failure
    assert copy.failure.signal_name == "SIGKILL"
    assert str(copy) == str(err) == str(failure)


def test_supervision_error_that_was_raised_survives_a_pickle_round_trip():
    try:
        raise SupervisionError(_failure(kind="stopped", cause="stopped by owner"))
    except SupervisionError as exc:
        copy = pickle.loads(pickle.dumps(exc))
    assert copy.failure.kind == "stopped"
    assert isinstance(copy, RuntimeError)


def _raise_boom() -> None:
    raise Boom("it broke")


def test_remote_failure_from_exception_captures_type_message_and_traceback():
    try:
        _raise_boom()
    except Boom as exc:
        failure = RemoteFailure.from_exception(exc)
    assert failure.remote_type == f"{Boom.__module__}.Boom"
    assert failure.remote_message == "it broke"
    assert failure.remote_traceback.startswith("Traceback (most recent call last):")
    assert "_raise_boom" in failure.remote_traceback
    assert failure.remote_traceback.rstrip().endswith("Boom: it broke")


def test_remote_failure_of_a_builtin_exception_uses_the_bare_type_name():
    try:
        {}["missing"]
    except KeyError as exc:
        failure = RemoteFailure.from_exception(exc)
    assert failure.remote_type == "KeyError"
    assert failure.remote_message == "'missing'"
    assert "KeyError: 'missing'" in failure.remote_traceback


def test_remote_failure_of_an_exception_never_raised_has_a_traceback_without_frames():
    failure = RemoteFailure.from_exception(ValueError("never raised"))
    assert failure.remote_type == "ValueError"
    assert failure.remote_traceback == "ValueError: never raised\n"


def test_remote_failure_to_error_builds_an_actor_error():
    failure = RemoteFailure("ValueError", "bad", "tb text")
    err = failure.to_error(mesh_name="m", rank=2, endpoint="go")
    assert isinstance(err, ActorError)
    assert (err.mesh_name, err.rank, err.endpoint) == ("m", 2, "go")
    assert (err.remote_type, err.remote_message, err.remote_traceback) == (
        "ValueError",
        "bad",
        "tb text",
    )


def test_remote_failure_is_picklable():
    failure = RemoteFailure("ValueError", "bad", "tb text")
    assert pickle.loads(pickle.dumps(failure)) == failure


def test_a_mesh_failure_reports_where_it_started_in_monarchs_words_then_its_chain():
    child = MeshFailure(
        "inner",
        (0,),
        "proc_died",
        "proc (pid 7) killed by SIGKILL",
        signal=9,
        actor="<m.Worker w{'gpus': 0/1}>",
    )
    failure = MeshFailure("outer", (1, 2), "child_failed", "a mesh it owns failed", child=child)
    assert failure.report() == (
        "The actor <m.Worker w{'gpus': 0/1}> and all its descendants have failed:\n"
        "  the process this actor was running on failed: Killed(sig=9)\n"
        "How it came here:\n"
        "  child_failed: mesh 'outer' rank(s) 1,2: a mesh it owns failed\n"
        "    proc_died: mesh 'inner' rank(s) 0: proc (pid 7) killed by SIGKILL"
    )
    exited = MeshFailure("m", (3,), "proc_died", "proc (pid 8) exited with code 2", exit_code=2)
    assert exited.report().splitlines()[:2] == [
        "The actor on mesh 'm' rank(s) 3 and all its descendants have failed:",
        "  the process this actor was running on exited with non-zero code 2",
    ]
    raised = MeshFailure("a", (0,), "endpoint_error", "broadcast to run raised ValueError: x")
    assert raised.report().splitlines()[1] == "  broadcast to run raised ValueError: x"
    assert str(failure) == (
        "MeshFailure(mesh_name=outer, crashed_ranks=[1, 2], event=child_failed: a mesh it owns "
        "failed) <- MeshFailure(mesh_name=inner, crashed_ranks=[0], event=proc_died: proc (pid 7) "
        "killed by SIGKILL)"
    )
