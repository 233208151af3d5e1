"""`raymesh federated job.toml [--tls-cert C --tls-key K]`: a federated run from a job file
(raymesh.federated.jobfile), with a line per round: clients sampled, responded and dropped,
accuracy, loss, epsilon. With an [edge] table and no token in it, the token is
$RAYMESH_FL_TOKEN, or else one generated and written to a file only its owner can read, whose
path is printed (the token itself is never printed nor logged).
`raymesh federated client --server URL --client module:fn [--token-file F] [--ca-file PEM]`:
an edge client, its token from --token-file or $RAYMESH_FL_TOKEN (--token T works, with a
warning: a command line is public to the machine's users)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import secrets
import sys
import tempfile
from typing import Any, TextIO

from raymesh.cli import errors
from raymesh.cli.args import add_tls_arguments

__all__ = ["RoundBar", "add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser("federated", help="run federated learning from a TOML file, or a client")
    p.add_argument("job", help="TOML job file, or `client` to run an edge client")
    p.add_argument("--rounds", type=int, help="override rounds")
    p.add_argument("--clients", type=int, help="override the number of simulated clients")
    p.add_argument("--server", help="client: the federated server's URL")
    p.add_argument(
        "--token",
        help="client: the server's bearer token; other users can read it in the process list "
        "(ps): prefer --token-file or $RAYMESH_FL_TOKEN",
    )
    p.add_argument("--token-file", help="client: a file whose first line is the bearer token")
    p.add_argument("--client", help="client: module:function building this device's client")
    p.add_argument("--timeout", type=float, default=60.0, help="client: seconds per request")
    p.add_argument("--threads", type=int, help="client: torch threads")
    p.add_argument("--ca-file", help="client: PEM certificate(s) to trust for an https:// server")
    p.add_argument("--device", help="client: this device's id for enrolment (default: host-pid)")
    add_tls_arguments(p)  # the job's edge server


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
        # The edge client is a script of its own (a device runs it without raymesh installed).
        from raymesh.federated.edge import device as edge

        if not args.server or not args.client:
            return errors.say(
                "federated client", "give --server URL and --client module:fn", errors.USAGE
            )
        return edge.run_from_args(args)  # it reads --token-file or $RAYMESH_FL_TOKEN

    import logging

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return errors.run("federated", lambda: _federated(args), mistakes=(ValueError, TypeError))


def _federated(args: argparse.Namespace) -> int:
    from raymesh import federated as fl

    tls = fl.Tls.of(args.tls_cert, args.tls_key)
    job = fl.load_job(args.job, tls=tls, rounds=args.rounds, clients=args.clients)
    config = _with_token(job.config)
    result = fl.run(
        job.client_fn,
        job.strategy,
        evaluate_fn=job.evaluate_fn,
        on_round=RoundBar(config.rounds),
        **{f.name: getattr(config, f.name) for f in dataclasses.fields(config)},
    )
    applied = sum(r.applied for r in result.history)
    last = result.history[-1]
    line = f"done: {applied}/{len(result.history)} rounds applied"
    if "accuracy" in last.metrics:
        line += f", accuracy {last.metrics['accuracy']:.4f}"
    if result.epsilon is not None:
        line += f", epsilon {result.epsilon:.3f}"
    print(line)
    return 0


def _with_token(config: Any) -> Any:
    """`config` with its edge server's token settled: the job's, $RAYMESH_FL_TOKEN, or a new
    one written to a file of a new private folder (0600 in 0700), whose path is printed."""
    edge = config.edge
    if edge is None or edge.token is not None:
        return config
    token = os.environ.get("RAYMESH_FL_TOKEN")
    if not token:
        token = secrets.token_urlsafe(24)
        path = os.path.join(tempfile.mkdtemp(prefix="raymesh-federated-"), "edge-token")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(token + "\n")
        print(
            f"raymesh federated: edge clients' token generated into {path} (only you can read "
            f"it): raymesh federated client --token-file {path} --server ...",
            file=sys.stderr,
        )
    return dataclasses.replace(config, edge=dataclasses.replace(edge, token=token))
