"""A study as a TOML job file (`raymesh tune job.toml`): TrainConfig's fields at the top, and a
`[tune]` table of `run`'s arguments with the space as `[tune.space]`:

    build = "my_project.train:build"
    workers = 2
    steps = 200
    global_batch_size = 64

    [tune]
    trials = 32
    concurrent = 4
    scheduler = "asha"                # "hyperband", "median", or "none"
    storage = "runs/study.db"

    [tune.space]
    lr = "loguniform(1e-4, 1e-1)"
    width = "choice([64, 128, 256])"
    depth = 2                         # a constant

A domain is written as its function call, with literal arguments only (nothing is evaluated).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

from raymesh._common import read_toml, split_job
from raymesh.train import TrainConfig, load_config
from raymesh.tune import space as spaces

__all__ = ["load_study"]

_CALL = re.compile(r"^\s*(loguniform|uniform|randint|choice)\s*\((.*)\)\s*$", re.S)
_RUN_KEYS = ("trials", "concurrent", "metric", "mode", "scheduler", "sampler", "storage", "seed")


def parse_domain(name: str, text: str) -> Any:
    """`"loguniform(1e-4, 1e-1)"` -> the domain; any other string is a constant."""
    match = _CALL.match(text)
    if match is None:
        return text
    fn, args = match.groups()
    try:
        values = ast.literal_eval(f"({args},)") if args.strip() else ()
    except (ValueError, SyntaxError):
        raise ValueError(
            f"tune.space.{name} = {text!r}: the arguments must be literals, e.g. "
            "'loguniform(1e-4, 1e-1)' or 'choice([64, 128])'"
        ) from None
    try:
        return getattr(spaces, fn)(*values)
    except TypeError as e:
        raise ValueError(f"tune.space.{name} = {text!r}: {e}") from None


def load_study(path: str | Path) -> tuple[TrainConfig, dict[str, Any]]:
    """The job's TrainConfig and `run`'s keyword arguments (with `space`); the tables other
    commands own ([serve]) are skipped. Raises ValueError naming the file and the field for a
    missing `[tune]` table, an unknown key or a bad domain."""
    path = Path(path)
    _, tables = split_job(read_toml(path))
    table = tables.get("tune")
    if not isinstance(table, dict) or not isinstance(table.get("space"), dict):
        raise ValueError(f"{path}: add a [tune] table with a [tune.space] table of parameters")
    raw_space = table.pop("space")
    unknown = sorted(set(table) - set(_RUN_KEYS))
    if unknown:
        raise ValueError(f"{path}: [tune] has unknown key(s) {unknown}; the keys are {_RUN_KEYS}")
    kwargs = dict(table)
    if kwargs.get("scheduler") == "none":  # TOML has no null
        kwargs["scheduler"] = None
    kwargs["space"] = {
        k: parse_domain(k, v) if isinstance(v, str) else v for k, v in raw_space.items()
    }
    return load_config(path, build=True), kwargs
