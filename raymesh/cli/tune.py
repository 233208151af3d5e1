"""`raymesh tune job.toml`: a study from a job file (raymesh.tune.jobfile), with a table of its
trials printed as each one ends."""

from __future__ import annotations

import argparse
from typing import Any

from raymesh.cli import errors

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("tune", help="run a hyperparameter study described by a TOML file")
    p.add_argument("job", help="TOML file: TrainConfig's fields, and a [tune] table")
    p.add_argument("--trials", type=int, help="override [tune] trials")
    p.add_argument("--resume", action="store_true", help="continue the study in [tune] storage")


def table(study: Any) -> str:
    """The trials as aligned text: number, state, step, metric, parameters."""
    rows = [["trial", "state", "step", study.metric, "params"]]
    for t in study.trials:
        value = "-" if t.value is None else f"{t.value:.4g}"
        params = ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in t.params.items()
        )
        rows.append([str(t.number), t.state, str(t.step), value, params])
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows
    )


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return errors.run("tune", lambda: _study(args))


def _study(args: argparse.Namespace) -> int:
    from raymesh import tune

    def show(study: Any) -> None:
        print(table(study), flush=True)
        print(flush=True)

    config, kwargs = tune.load_study(args.job)
    if args.trials is not None:
        kwargs["trials"] = args.trials
    assert config.build is not None  # load_study checked it
    study = tune.run(config.build, config, resume=args.resume, progress=show, **kwargs)
    show(study)
    try:
        best = study.best
    except ValueError as e:  # no trial finished: the study ran, and failed
        return errors.say("tune", e, errors.FAILED)
    print(f"best: trial {best.number}, {study.metric} {best.value:.4g}, params {best.params}")
    if best.checkpoint:
        print(f"checkpoint: {best.checkpoint}")
    return 0
