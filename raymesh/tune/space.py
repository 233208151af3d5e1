"""Search spaces: named parameters, each a domain to sample from or a constant.

    {"lr": tune.loguniform(1e-4, 1e-1), "width": tune.choice([64, 128, 256]), "depth": 2}

Domains map onto Optuna's distributions (Optuna samples them). Ray Tune's own domains
(`ray.tune.loguniform(...)`, `ray.tune.choice(...)`, `ray.tune.randint(...)`, ...) are accepted
as they are, so a Ray user's space works unchanged; they are read by their attributes
(`lower`, `upper`, `categories`, the sampler's class), never imported.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Domain", "choice", "loguniform", "randint", "to_distributions", "uniform"]


@dataclass(frozen=True)
class Domain:
    """One parameter's domain: "float" in [low, high] (`log`: sampled in log space), "int" in
    [low, high), or "choice" among `options`."""

    kind: str
    low: float = 0.0
    high: float = 0.0
    log: bool = False
    options: tuple[Any, ...] = ()


def loguniform(low: float, high: float) -> Domain:
    """A float in [low, high], uniform in log space (learning rates, weight decay)."""
    return Domain("float", float(low), float(high), log=True)


def uniform(low: float, high: float) -> Domain:
    """A float in [low, high]."""
    return Domain("float", float(low), float(high))


def randint(low: int, high: int) -> Domain:
    """An int in [low, high) (Ray Tune's convention)."""
    return Domain("int", int(low), int(high))


def choice(options: Sequence[Any]) -> Domain:
    """One of `options` (numbers, strings, booleans or None)."""
    return Domain("choice", options=tuple(options))


def _from_ray(value: Any) -> Domain | None:
    """A Ray Tune domain (ray.tune.search.sample), read by its attributes."""
    if not type(value).__module__.startswith("ray.tune"):
        return None
    name = type(value).__name__
    if name == "Categorical":
        return choice(value.categories)
    sampler = type(getattr(value, "sampler", None)).__name__
    log = sampler.lstrip("_") == "LogUniform"
    if name == "Float":
        return Domain("float", float(value.lower), float(value.upper), log=log)
    if name == "Integer":
        return Domain("int", int(value.lower), int(value.upper), log=log)
    raise ValueError(f"a Ray Tune {name} domain is not supported; use loguniform, uniform, ...")


def _check(name: str, d: Domain) -> None:
    where = f"space[{name!r}]"
    if d.kind == "choice":
        if not d.options:
            raise ValueError(f"{where}=choice([]): give at least one option")
        bad = [o for o in d.options if not isinstance(o, (int, float, str, bool, type(None)))]
        if bad:
            raise ValueError(f"{where}: option {bad[0]!r} is not a number, string, bool or None")
        return
    if not (math.isfinite(d.low) and math.isfinite(d.high)) or d.low >= d.high:
        raise ValueError(f"{where}: low={d.low} must be below high={d.high}, both finite")
    if d.log and d.low <= 0:
        raise ValueError(f"{where}: a log domain needs low > 0, not {d.low}")


def domains(space: Mapping[str, Any]) -> tuple[dict[str, Domain], dict[str, Any]]:
    """The space's domains and its constants, checked. Raises ValueError naming the parameter
    for an empty space, a bad domain, or a name that is not a string."""
    if not isinstance(space, Mapping) or not space:
        raise ValueError(
            f"space={space!r}: give a dict of parameters, e.g. "
            "{'lr': tune.loguniform(1e-4, 1e-1)}"
        )
    found: dict[str, Domain] = {}
    constants: dict[str, Any] = {}
    for name, value in space.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"space: parameter name {name!r} must be a non-empty string")
        d = value if isinstance(value, Domain) else _from_ray(value)
        if d is None:
            constants[name] = value
            continue
        _check(name, d)
        found[name] = d
    if not found:
        raise ValueError(
            f"space={dict(space)!r} has no domain to search, only constants; give at least one "
            "tune.loguniform / uniform / randint / choice"
        )
    return found, constants


def to_distributions(found: Mapping[str, Domain]) -> dict[str, Any]:
    """Optuna distributions for the domains."""
    import optuna.distributions as od

    out: dict[str, Any] = {}
    for name, d in found.items():
        if d.kind == "choice":
            out[name] = od.CategoricalDistribution(list(d.options))
        elif d.kind == "int":
            out[name] = od.IntDistribution(int(d.low), int(d.high) - 1, log=d.log)
        else:
            out[name] = od.FloatDistribution(d.low, d.high, log=d.log)
    return out
