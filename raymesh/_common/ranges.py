"""`Range`: a count, or (min, max) to scale between (a job's workers, a server's replicas, a
pipeline's preprocessing procs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from raymesh._common.fields import bad, is_int

__all__ = ["Range"]


@dataclass(frozen=True)
class Range:
    """The bounds of a count or (min, max): `min == max` for a count."""

    min: int
    max: int

    @classmethod
    def of(cls, value: int | tuple[int, int]) -> Range:
        """The bounds of a value `check` accepted."""
        return cls(value, value) if isinstance(value, int) else cls(*value)

    @staticmethod
    def check(
        field: str, value: Any, *, minimum: int = 1, count_minimum: int | None = None
    ) -> int | tuple[int, int]:
        """`value` as a count or a (min, max) tuple (a list, as TOML gives it, becomes a
        tuple); ValueError naming `field`, the value and the fix unless it is a count >=
        `count_minimum` (default `minimum`) or two integers with `minimum` <= min <= max."""
        if isinstance(value, list):
            value = tuple(value)
        if isinstance(value, tuple):
            if len(value) != 2:
                raise bad(field, value, "give a count, or (min, max) such as (2, 4)")
            if not all(is_int(v) and v >= minimum for v in value):
                raise bad(field, value, f"give (min, max) as integers >= {minimum}")
            if value[0] > value[1]:
                raise bad(field, value, "min must be <= max, as in (2, 4)")
            return value
        low = minimum if count_minimum is None else count_minimum
        if not is_int(value) or value < low:
            raise bad(field, value, f"give an integer >= {low}, or (min, max) such as (2, 4)")
        return value
