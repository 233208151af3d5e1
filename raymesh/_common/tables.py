"""Job files: a TOML file read into tables, each table made into a keyword-only dataclass.

One job file carries a model from training through a study to serving: its top level (with
`[checkpoint]` and `[data]`, which are TrainConfig fields) is the training job every command
reads, and each table in `TABLES` belongs to one command, which reads it and which every
other command skips:

    build = "my_project.train:build"          # raymesh train, tune and serve: the job
    workers = 2
    [checkpoint]
    dir = "runs/job"
    [tune]                                    # raymesh tune only
    trials = 8
    [serve]                                   # raymesh serve only
    replicas = [1, 4]

(A federated job file is a file of its own: its top level is `raymesh federated`'s.)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "TABLES",
    "from_table",
    "read_toml",
    "section_of",
    "split_job",
    "store_sections",
    "stored",
]

T = TypeVar("T")

# Which command owns each top-level table of a training job file. A new command that reads a
# table of its own registers it here, so that the other readers skip it.
TABLES = {"tune": "raymesh tune", "serve": "raymesh serve"}


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML job file's tables. Raises ValueError for a missing file or invalid TOML."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    path = Path(path)
    try:
        return tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid TOML: {e}") from None


def split_job(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the training job: the top level without the tables in `TABLES`, those tables by name).
    Each command reads the job and its own table, and so skips every other command's."""
    job = {k: v for k, v in data.items() if k not in TABLES}
    return job, {k: v for k, v in data.items() if k in TABLES}


def from_table(cls: type[T], data: Any, table: str | None = None) -> T:
    """`cls(**data)` for a keyword-only dataclass, from a parsed table.

    table: the table's name in the file ("serve", "edge.tls"); None for the top level.
    Raises ValueError for a value that is not a table, an unknown key (naming the unknown keys
    and the valid ones), a missing required key or a field that `cls` refuses; the message
    names `[table]`, unless the field's own error names it already (`data.workers=...`)."""
    where = f"[{table}]" if table is not None else cls.__name__
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table of keys, got {type(data).__name__}")
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    names = {f.name for f in fields}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; the keys are {sorted(names)}")
    missing = [
        f.name
        for f in fields
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ValueError(f"{where} is missing key(s) {missing}: give them")
    try:
        return cls(**data)
    except TypeError as e:  # a field of a kind the dataclass itself refused
        raise ValueError(f"{where}: {e}") from None
    except ValueError as e:
        if table is None or str(e).startswith((f"{table}.", f"[{table}]")):
            raise
        raise ValueError(f"{where} {e}") from None


def section_of(cls: type[T], config: Any) -> T:
    """The section `cls` (a dataclass) of a config written flat (`train.TrainConfig`,
    `rl.RLConfig`): built from the config's fields of the same names, so it checks them."""
    return cls(**{f.name: getattr(config, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def store_sections(config: Any, classes: dict[str, type]) -> None:
    """Build each section of a frozen config written flat once, from its `__post_init__`
    (`classes`: name -> section dataclass): each checks its fields, the config's fields take
    the values it normalised (a TOML list to a tuple), and the config keeps the sections, so
    that reading one (`stored`) neither rebuilds nor checks it again. They are not fields:
    `dataclasses.replace` builds them anew, equality and `asdict` ignore them."""
    sections: dict[str, Any] = {name: section_of(cls, config) for name, cls in classes.items()}
    for section in sections.values():
        for f in dataclasses.fields(section):
            object.__setattr__(config, f.name, getattr(section, f.name))
    object.__setattr__(config, "_sections", sections)


def stored(config: Any, name: str, cls: type[T]) -> T:
    """The section `name` that `store_sections` kept on `config`."""
    section = config.__dict__["_sections"][name]
    assert isinstance(section, cls)
    return section
