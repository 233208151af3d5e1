"""`Accumulator`: call an endpoint on every actor of a mesh and fold the replies into one value.

`Accumulator(mesh.get_count, 0, lambda total, n: total + n).accumulate()` is a `Future` of the
sum of every actor's `get_count()`, as in Monarch.

Guarantees:
- The messages are sent before `accumulate` returns, from the caller's thread, so they keep
  their place in the caller's FIFO order like any other call (`stream` underneath).
- The fold runs off the caller's thread (one short-lived thread per `accumulate`), starting
  from `identity` and taking replies in order of arrival: `combine(combine(identity, r1), r2)`.
  Give an associative, commutative `combine` for a result that does not depend on timing.
  `identity` is used as it is, not copied: a `combine` that mutates it changes it for the next
  `accumulate` too.
- Failures surface from the future as from `call`: `ActorError` when an endpoint raised,
  `SupervisionError` when a proc is gone, and whatever `combine` raised. The first failure to
  arrive ends the fold (later replies are dropped); a mesh that had already failed gives a
  future that fails at once. `get(timeout=...)` raises TimeoutError and the fold runs on.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from raymesh._src.actor_mesh import EndpointRef
from raymesh._src.future import Future

R = TypeVar("R")
A = TypeVar("A")

__all__ = ["Accumulator"]


class Accumulator(Generic[R, A]):
    """Folds the replies of one endpoint across a mesh (or a slice of one) with `combine`,
    starting from `identity`."""

    def __init__(
        self, endpoint: EndpointRef[Any], identity: A, combine: Callable[[A, R], A]
    ) -> None:
        """endpoint: a mesh's endpoint, `mesh.method` (an `EndpointRef`); identity: the value
        before the first reply; combine(accumulated, reply) -> the new accumulated value."""
        if not callable(getattr(endpoint, "stream", None)):
            raise TypeError(
                f"Accumulator({endpoint!r}, ...): pass the endpoint of a mesh, e.g. "
                "Accumulator(counters.get_value, 0, operator.add), not the class's method"
            )
        if not callable(combine):
            raise TypeError(f"Accumulator(..., combine={combine!r}): combine must be callable")
        self._endpoint = endpoint
        self._identity = identity
        self._combine = combine

    def accumulate(self, *args: Any, **kwargs: Any) -> Future[A]:
        """Call the endpoint with these arguments on every actor now; the future gives the
        folded value once every reply is in."""
        replies: Iterator[Future[R]] = self._endpoint.stream(*args, **kwargs)
        folded: concurrent.futures.Future[tuple[BaseException | None, Any]]
        folded = concurrent.futures.Future()

        def fold() -> None:
            value = self._identity
            try:
                for reply in replies:
                    value = self._combine(value, reply.get())
            except BaseException as e:
                folded.set_result((e, None))
                return
            folded.set_result((None, value))

        threading.Thread(target=fold, name="raymesh-accumulate", daemon=True).start()
        name = getattr(self._endpoint, "_name", "endpoint")
        return Future([folded], _outcome, _never_gone, f"accumulate of {name}")


def _outcome(raws: list[Any]) -> Any:
    error, value = raws[0]
    if error is not None:
        raise error
    return value


def _never_gone(index: int, detail: str) -> BaseException:  # the fold reports deaths itself
    return AssertionError(f"the accumulate fold failed unexpectedly: {detail}")
