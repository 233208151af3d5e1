"""Argument types shared by the commands."""

from __future__ import annotations

import argparse

__all__ = ["add_tls_arguments", "count_or_range"]


def count_or_range(text: str) -> int | tuple[int, int]:
    """`4` -> 4, `2:4` -> (2, 4) (workers, replicas: a count, or min:max to scale between)."""
    try:
        if ":" in text:
            low, high = text.split(":")
            return (int(low), int(high))
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a count such as 4, or min:max such as 2:4"
        ) from None


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls-cert and --tls-key: serve HTTPS (read back with `raymesh._common.Tls.of`)."""
    parser.add_argument("--tls-cert", help="serve HTTPS with this PEM certificate (and --tls-key)")
    parser.add_argument("--tls-key", help="the private key of --tls-cert (PEM)")
