"""`raymesh export RUN --hf OUT`: a trained model out of raymesh, as a Hugging Face folder that
`from_pretrained` reads and `raymesh serve --hf OUT` serves. RUN is a run's checkpoint folder
(its newest committed step that verifies) or one step-XXXXXXXX folder. The model is rebuilt by
the job's build function, or, where the job names none importable here (a function of the
user's script), from the Hugging Face record its checkpoints carry (`--build` wins when given).

    raymesh export runs/lora --hf out/lora                # the LoRA adapter (and tokenizer)
    raymesh export runs/lora --hf out/merged --merge      # base + adapter, one model
    raymesh export runs/full/step-00000100 --hf out/full  # a full fine-tune's model
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from raymesh.cli import errors

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "export",
        help="write a trained model as a Hugging Face folder (export RUN --hf OUT)",
        description="Write the model of a raymesh.train checkpoint as a Hugging Face folder.",
    )
    p.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="checkpoint or step folder")
    p.add_argument(
        "--hf", required=True, metavar="OUT", help="the new folder to write (never overwritten)"
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="merge a LoRA adapter into its base and write the whole model",
    )
    p.add_argument(
        "--build",
        metavar="MODULE:FUNCTION",
        help="the build function that trained it (default: the one the run's job names, or "
        "for a transformers or PEFT model the model its checkpoint records)",
    )


def run(args: argparse.Namespace) -> int:
    from raymesh.train.checkpoint import CheckpointError  # a corrupt checkpoint: the user's

    return errors.run("export", lambda: _export(args), mistakes=(ValueError, CheckpointError))


def _export(args: argparse.Namespace) -> int:
    from raymesh import train
    from raymesh.train.checkpoint import resolve_checkpoint

    try:  # the command says what it did in a line; transformers' loading bars would bury it
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:  # export_hf says what is missing
        pass
    step = resolve_checkpoint(args.checkpoint)
    out = train.export_hf(step, args.hf, build=args.build, merge=args.merge)
    if args.merge:
        what = "the merged model (base + LoRA adapter)"
    elif (Path(out) / "adapter_config.json").is_file():
        what = "the LoRA adapter (load it on its base with peft.PeftModel.from_pretrained)"
    else:
        what = "the full model"
    print(f"exported {what} of {step} to {out}")
    return 0
