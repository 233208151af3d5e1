"""`raymesh federated job.toml`: a federated run from a job file (raymesh.federated.jobfile),
with a line per round: clients sampled, responded and dropped, accuracy, loss, epsilon.
`raymesh federated client --server URL --token T --client module:fn`: an edge client."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

__all__ = ["RoundBar", "add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("federated", help="run federated learning from a TOML file, or a client")
    p.add_argument("job", help="TOML job file, or `client` to run an edge client")
    p.add_argument("--rounds", type=int, help="override rounds")
    p.add_argument("--clients", type=int, help="override the number of simulated clients")
    p.add_argument("--server", help="client: the federated server's URL")
    p.add_argument("--token", help="client: the server's bearer token (or RAYMESH_FL_TOKEN)")
    p.add_argument("--client", help="client: module:function building this device's client")
    p.add_argument("--timeout", type=float, default=60.0, help="client: seconds per request")
    p.add_argument("--threads", type=int, help="client: torch threads")


class RoundBar:
    """One line per round, with a bar of the rounds done."""

    def __init__(self, rounds: int, stream: TextIO | None = None, width: int = 20) -> None:
        self.rounds, self.width = rounds, width
        self.stream = stream or sys.stderr

    def __call__(self, r: Any) -> None:
        filled = int(self.width * r.round / self.rounds)
        bar = "#" * filled + "." * (self.width - filled)
        parts = [
            f"round {r.round}/{self.rounds} [{bar}]",
            f"clients {r.responded}/{r.sampled}",
            f"dropped {len(r.dropped)}",
        ]
        for key in ("accuracy", "loss"):
            if key in r.metrics:
                parts.append(f"{key} {r.metrics[key]:.4f}")
        if r.epsilon is not None:
            parts.append(f"epsilon {r.epsilon:.3f}")
        parts.append(f"{r.seconds:.2f} s")
        if r.replaced_hosts:
            parts.append(f"replaced {r.replaced_hosts} proc(s)")
        if not r.applied:
            parts.append("NOT APPLIED")
        self.stream.write(" ".join(parts) + "\n")
        self.stream.flush()


def run(args: argparse.Namespace) -> int:
    if args.job == "client":
        import os

        from raymesh.federated import edge

        if not args.server or not args.client:
            print(
                "raymesh federated client: give --server URL and --client module:fn",
                file=sys.stderr,
            )
            return 2
        args.token = args.token or os.environ.get("RAYMESH_FL_TOKEN")
        return edge.run_from_args(args)

    import logging

    from raymesh import federated as fl
    from raymesh.federated.jobfile import load_job

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        job = load_job(args.job, rounds=args.rounds, clients=args.clients)
        result = fl.run(
            job.client_fn,
            job.strategy,
            evaluate_fn=job.evaluate_fn,
            on_round=RoundBar(job.config.rounds),
            **{f: getattr(job.config, f) for f in job.config.__dataclass_fields__},
        )
    except (ValueError, TypeError) as e:  # a user mistake: one clear line, no traceback
        print(f"raymesh federated: {e}", file=sys.stderr)
        return 2
    applied = sum(r.applied for r in result.history)
    last = result.history[-1]
    line = f"done: {applied}/{len(result.history)} rounds applied"
    if "accuracy" in last.metrics:
        line += f", accuracy {last.metrics['accuracy']:.4f}"
    if result.epsilon is not None:
        line += f", epsilon {result.epsilon:.3f}"
    print(line)
    return 0
