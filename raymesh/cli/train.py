"""`raymesh train job.toml`: a training job from a job file (TrainConfig as TOML), with a live
progress bar; at the end a line per healed failure, the last step's loss and the checkpoint, and
`run.png` in the run folder. With `--dashboard`, the job's web page too, live (the URL is
printed).

    raymesh train examples/tinygpt.toml --inject kill:rank=1:step=30 --dashboard
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from raymesh.cli import dashboard as dashboard_cli
from raymesh.cli import errors
from raymesh.cli.args import count_or_range

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="run a training job described by a TOML file")
    p.add_argument("job", help="TOML file whose keys are TrainConfig's fields")
    p.add_argument("--steps", type=int, help="override steps (e.g. to train further)")
    p.add_argument(
        "--workers",
        type=count_or_range,
        help="override workers: N, or MIN:MAX for elastic training",
    )
    p.add_argument("--spares", type=int, help="override spares (warm procs for healing)")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest valid checkpoint (e.g. after the controller died)",
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND:rank=R:step=S",
        help="inject a fault (kill, fail, hang), e.g. kill:rank=1:step=30; repeatable",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="also show Ray's own messages (raymesh reports worker deaths itself)",
    )
    p.add_argument(
        "--dashboard",
        action="store_true",
        help="serve the job's web page while it runs (prints the URL; needs raymesh[dashboard])",
    )
    p.add_argument(
        "--dashboard-port",
        type=int,
        default=dashboard_cli.DEFAULT_PORT,
        metavar="PORT",
        help=f"the dashboard's port (default {dashboard_cli.DEFAULT_PORT}; taken: any free one)",
    )


def run(args: argparse.Namespace) -> int:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.verbose:  # Ray's own messages too, e.g. its paragraph on each dead worker
        logging.getLogger("raymesh.ray").setLevel(logging.DEBUG)
    return errors.run("train", lambda: _train(args))


def _train(args: argparse.Namespace) -> int:
    import dataclasses

    from raymesh import train
    from raymesh.cli.progress import ProgressBar

    config = train.load_config(args.job, build=True)
    pairs = (("steps", args.steps), ("workers", args.workers), ("spares", args.spares))
    overrides: dict[str, Any] = {k: v for k, v in pairs if v is not None}
    if args.inject:
        overrides["faults"] = tuple(args.inject)
    if args.resume:
        overrides["resume"] = True
    if overrides:
        config = dataclasses.replace(config, **overrides)
    if args.dashboard and config.run_folder() is None:  # the page reads the run folder
        config = dataclasses.replace(config, run_dir=f"runs/{Path(args.job).stem}")
    board = None
    if args.dashboard:
        board = dashboard_cli.serve_for(Path(str(config.run_folder())), args.dashboard_port)
    try:
        result = train.fit(None, config, progress=ProgressBar())
    finally:
        if board is not None:
            _linger(board)
    last = result.history[-1] if result.history else {"step": result.resumed_from, "loss": 0.0}
    for f in result.failures:
        print(
            f"healed: {f} (recovered in {f.recovery_s or 0:.2f}s, "
            f"{f.steps_recomputed or 0} step(s) recomputed)"
        )
    print(
        f"done: step {last['step']}, loss {last['loss']:.4f}, "
        f"strategy {result.decision.strategy}, checkpoint {result.checkpoint}"
    )
    run_dir = config.run_folder()
    if run_dir and result.history:
        try:
            picture = train.save_picture(result, Path(run_dir) / "run.png", title=args.job)
            print(f"picture: {picture}")
        except ImportError as e:  # matplotlib is optional
            print(f"no picture: {e}")
    return 0


def _linger(board: Any) -> None:
    """The job ended: keep its page up until Enter where someone is at the terminal."""
    if sys.stdin.isatty():
        try:
            input(f"dashboard: still at {board.url}; press Enter to stop it ")
        except (EOFError, KeyboardInterrupt):
            pass
    board.stop()
