"""`python -m raymesh.train.hf tiny-llama OUT`: save a small Llama-architecture model, built from
a config (nothing downloaded), with its byte-level tokenizer, for examples/finetune.toml."""

from __future__ import annotations

import argparse

from raymesh.train.hf import save_tiny_llama


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m raymesh.train.hf", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    tiny = sub.add_parser("tiny-llama", help="save a small Llama model and tokenizer to OUT")
    tiny.add_argument("out", help="a new folder")
    tiny.add_argument("--hidden-size", type=int, default=128)
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--heads", type=int, default=4)
    tiny.add_argument("--kv-heads", type=int, default=2)
    tiny.add_argument("--intermediate-size", type=int, default=344)
    tiny.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    from transformers.utils import logging

    logging.disable_progress_bar()  # one line of its own below says what was written
    try:
        out = save_tiny_llama(
            a.out,
            hidden_size=a.hidden_size,
            layers=a.layers,
            heads=a.heads,
            kv_heads=a.kv_heads,
            intermediate_size=a.intermediate_size,
            seed=a.seed,
        )
    except ValueError as e:
        p.exit(2, f"error: {e}\n")
    print(f"saved a {a.layers}-layer Llama (hidden {a.hidden_size}) and its tokenizer to {out}")


if __name__ == "__main__":
    main()
