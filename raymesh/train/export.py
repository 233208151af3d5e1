"""A trained model out of raymesh: rebuilt from its checkpoint as a rank of its job built it
(`rebuild`), and written as a Hugging Face folder that `from_pretrained` reads (`export_hf`,
`raymesh export RUN --hf OUT`).

    from raymesh import train
    train.export_hf("runs/lora", "out/lora")  # the run's newest checkpoint: an adapter folder
    train.export_hf("runs/lora", "out/merged", merge=True)  # base + adapter, one model

A job whose build function cannot be imported here (one of the user's script) still exports
when its model is a transformers or PEFT one: its checkpoints record the model (`Manifest.hf`)
and `from_record` rebuilds it from that, running no build function.

Nothing here needs a process group or a GPU: the model is built on the CPU, in this process,
and the checkpoint's weights are read with `export_state_dict` (checksums verified, tensors
only: no checkpoint file runs code here).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from raymesh._common import bad, new_folder, resolve
from raymesh.train.checkpoint import (
    CheckpointError,
    Manifest,
    check_record,
    load_weights,
    read_manifest,
    resolve_checkpoint,
)
from raymesh.train.config import TrainConfig
from raymesh.train.materialize import materialize, on_meta, repointed
from raymesh.train.task import Context, Task

__all__ = ["export_hf", "from_record", "job_config", "rebuild", "rebuild_plan"]

Build = str | Callable[[Context], Task]


def rebuild(
    checkpoint: str | Path | None = None,
    *,
    build: Build | None = None,
    device: torch.device | str = "cpu",
    seed: int | None = None,
    params: dict[str, Any] | None = None,
) -> Task:
    """The Task that `build` makes as the one rank of a one-rank job, with the model weights of
    `checkpoint` loaded into `Task.model`, on `device` (a model built on the meta device is
    given the checkpoint's tensors, or without one filled by its `init_weights`).

    checkpoint: a run's checkpoint folder (its newest committed step that verifies) or one
        `step-XXXXXXXX` folder. None: the model as built, with its initial weights.
    build: the build function, or its "module:function" name; it wins when given. None: the
        one the checkpoint's job named (its manifest's `config.build`); where it names none, or
        one that cannot be imported here (a function of the user's script), a transformers or
        PEFT model is rebuilt from the checkpoint's Hugging Face record (`Manifest.hf`: its
        class, config and adapters; see `from_record`).
    device: the Context's device (where a build function that places its model puts it).
    seed: torch is seeded with it before `build` runs, as training seeds it, so the model is
        initialised as the job's was. None: the job's seed (0 without a checkpoint).
    params: the build function's `ctx.params` without a checkpoint (with one, its job's are
        used: giving both is a ValueError).

    With a checkpoint, the Context's `config` is the job's TrainConfig, read from the manifest,
    so the build function sees the `ctx.params` it trained with. Raises ValueError when there
    is no build function and no record, no committed checkpoint, or the checkpoint holds
    another model's weights (naming the keys that differ).
    """
    step = None if checkpoint is None else resolve_checkpoint(checkpoint)
    config = None if step is None else job_config(step)
    if params is not None:
        if config is not None:
            raise bad("params", params, "the checkpoint's job params are used: leave it out")
        config = TrainConfig(params=params)
    seed = seed if seed is not None else (config.seed if config is not None else 0)
    named = config.build if config is not None else None
    build = rebuild_plan(step, build, named=named)
    if build is None:
        if step is not None and _manifest(step).hf:
            return from_record(step, device=device, seed=seed)
        if named is not None:
            resolve(named)  # not importable here: raises, naming it
        where = f"checkpoint {str(step)!r} names none" if step is not None else "no checkpoint"
        raise ValueError(
            f"build=None: {where}; pass the build function that trained the model "
            "(`--build module:function`, or build= in Python)"
        )
    fn = resolve(build)
    torch.manual_seed(seed)  # as training seeds before build: the same init
    ctx = Context.alone(device=device, seed=seed, config=config)
    task = fn(ctx)
    if not isinstance(task, Task):
        raise ValueError(f"build={build!r} returned {type(task).__name__}: return a train.Task")
    if step is not None:
        # A model built on meta takes the checkpoint's tensors: new parameters, which the
        # optimizer is re-pointed at (a learner trains on with it).
        with repointed(task.model, task.optimizer) if on_meta(task.model) else nullcontext():
            load_weights(task.model, step)
    # What is still on meta (no checkpoint) is filled by init_weights.
    materialize(task.model, torch.device(device), task.init_weights, task.optimizer)
    return task


def from_record(
    checkpoint: str | Path, *, device: torch.device | str = "cpu", seed: int = 0
) -> Task:
    """The transformers or PEFT model that `checkpoint` recorded (`Manifest.hf`), with its
    weights, on `device`, in a Task for one rank: AdamW over what trains, the causal LM loss,
    no dataset. No build function runs: the class is looked up among transformers' exported
    model classes by its name (never imported from elsewhere), built on meta from the recorded
    config, given the recorded PEFT adapters, and filled with the checkpoint's tensors, which
    must fit it key for key. Its name_or_path is the recorded base folder (its tokenizer's).

    ValueError naming the checkpoint when it has no record, the record is malformed, its class
    is none of this transformers' models, or its weights do not fit."""
    step = resolve_checkpoint(checkpoint)
    where = f"checkpoint={str(step)!r}"
    try:
        import transformers
        from accelerate import init_empty_weights

        from raymesh.train import hf
    except ImportError as e:
        raise ValueError(
            f"{where}: rebuilding its model needs {e.name}: pip install 'raymesh[hf]'"
        ) from None
    record = _manifest(step).hf
    if not record:
        raise ValueError(
            f"{where}: its manifest records no Hugging Face model (saved by a raymesh before "
            "it did, or the model is no transformers one); pass its build function"
        )
    record = check_record(record, where)
    cls = getattr(transformers, record["class"], None)
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise bad(
            "hf.class",
            record["class"],
            f"{where}: not a model class of transformers {transformers.__version__}; install "
            f"the version that saved it ({record.get('transformers')}) or pass --build",
        )
    config_class: Any = getattr(cls, "config_class", None)
    if config_class is None or config_class.model_type not in ("", record["config"]["model_type"]):
        raise bad(
            "hf.config.model_type",
            record["config"]["model_type"],
            f"{where}: {cls.__name__} takes {getattr(config_class, 'model_type', None)!r} configs",
        )
    config = config_class.from_dict(dict(record["config"]))
    config._name_or_path = record.get("base") or ""  # where its tokenizer is
    torch.manual_seed(seed)
    with init_empty_weights():  # parameters on meta (the checkpoint fills them), buffers real
        model: Any = cls(config)
    if record.get("peft"):
        model = _with_adapters(model, record["peft"], where)
    load_weights(model, step)
    get_base: Any = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    if getattr(base.config, "tie_word_embeddings", False):
        base.tie_weights()  # the tensors were assigned: tie them again
    materialize(model, torch.device(device), None)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return Task(
        model=model,
        optimizer=torch.optim.AdamW(trainable or list(model.parameters())),
        loss_fn=hf.causal_lm_loss,
    )


def _with_adapters(model: Any, record: dict[str, Any], where: str) -> Any:
    try:
        import peft
    except ImportError:
        raise ValueError(f"{where}: its model has a PEFT adapter: pip install peft") from None
    active, adapters = record["active"], record["adapters"]
    try:
        configs = {name: peft.get_peft_config(dict(c)) for name, c in adapters.items()}
    except Exception as e:  # an unknown peft_type or field: what PEFT raises varies
        raise bad("hf.peft", adapters, f"{where}: not PEFT configs this peft reads ({e})") from None
    model = peft.get_peft_model(model, configs[active], adapter_name=active)
    for name, config in configs.items():
        if name != active:
            model.add_adapter(name, config)
    model.set_adapter(active)
    return model


_JOBS = object()  # rebuild_plan's default `named`: the one the checkpoint's job named


def rebuild_plan(
    step: Path | None, build: Build | None = None, *, named: str | object | None = _JOBS
) -> Build | None:
    """The one decision of how a checkpoint's model is rebuilt (`rebuild`, export, serve): the
    build function to call as one rank of its job, or None: from the checkpoint's Hugging Face
    record (`from_record`, where it has one; no build function runs).

    build: given, it wins. Else `named` (default: the build function the job of step folder
    `step` named, its manifest's `config.build`) where it imports here; None where it names
    none or one that does not import here (a function of the user's script).

    Deciding imports the named build's module, which runs its code: decide on a checkpoint
    whose writer you trust (serve decides once, at deploy, and a reload keeps that decision)."""
    if build is not None:
        return build
    if named is _JOBS:
        named = job_config(step).build if step is not None else None
    if not isinstance(named, str):
        return None
    try:
        resolve(named)
    except ValueError:  # a function of the user's script: not importable here
        return None
    return named


def _manifest(step: Path) -> Manifest:
    try:
        return read_manifest(step)
    except (OSError, ValueError, CheckpointError) as e:
        raise ValueError(f"checkpoint={str(step)!r}: its manifest cannot be read ({e})") from None


def export_hf(
    checkpoint: str | Path,
    out: str | Path,
    *,
    build: Build | None = None,
    merge: bool = False,
) -> Path:
    """Write the model of `checkpoint` to the new folder `out` in Hugging Face's format;
    returns `out`.

    The model is `rebuild(checkpoint, build=build)`'s (the job's build function from the
    manifest unless `build` is given; where the job names none that imports here, the model
    the checkpoint's Hugging Face record describes), then:
    - a transformers model: `save_pretrained` (config.json, model.safetensors), plus the
      tokenizer of the folder it was loaded from, when that folder has one;
    - a PEFT model (LoRA): the adapter alone (adapter_config.json, adapter_model.safetensors,
      naming its base folder), and the base's tokenizer; with `merge`, the adapter is merged
      into the base weights (`merge_and_unload`) and the whole model is written instead.
    The exported config has `use_cache` on again (training turns it off; generation wants it).

    Atomic: written into a temporary sibling of `out`, renamed into place when complete; on any
    failure nothing is left at `out`. Raises ValueError when `out` exists (never overwritten),
    for a model that is not a transformers one, for `merge` without an adapter, and as
    `rebuild` does.
    """
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise bad("out", str(out), "it exists; give a new folder (export never overwrites)")
    try:
        import transformers

        from raymesh.train import hf  # the Hugging Face side: with transformers only
    except ImportError as e:
        raise ValueError(f"export_hf needs {e.name}: pip install 'raymesh[hf]'") from None
    model: Any = rebuild(checkpoint, build=build, device="cpu").model
    adapter = _is_peft(model)
    if not adapter and not isinstance(model, transformers.PreTrainedModel):
        raise ValueError(
            f"the build function's model is a {type(model).__name__}: export --hf needs a "
            "transformers model (PreTrainedModel, e.g. raymesh.train.hf:build's) or a PEFT one"
        )
    if merge and not adapter:
        raise bad("merge", merge, "the model has no LoRA adapter to merge into it; drop --merge")
    try:
        source: Path | None = hf.folder_of(model)
    except ValueError:  # not loaded from a folder: no tokenizer to carry along
        source = None
    if merge:
        model = model.merge_and_unload()
    if not adapter or merge:
        model.config.use_cache = True  # a KV cache speeds generation; only training avoids it
    with new_folder(out) as tmp:
        model.save_pretrained(tmp)  # safetensors: transformers' and peft's default format
        if source is not None and hf.has_tokenizer(source):
            hf.load_tokenizer(source).save_pretrained(tmp)
        if out.exists() or out.is_symlink():  # made meanwhile: still never overwritten
            raise bad("out", str(out), "it appeared while exporting; give a new folder")
    return out


def job_config(step: Path) -> TrainConfig:
    """The TrainConfig a checkpoint's job ran with, from its manifest."""
    try:
        return TrainConfig.from_dict(read_manifest(step).config)
    except (OSError, ValueError, CheckpointError) as e:
        raise ValueError(
            f"checkpoint={str(step)!r}: its manifest's job config cannot be read ({e}); pass "
            "the build function (--build module:function) of a job this raymesh can read"
        ) from None


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        import peft
    except ImportError:  # no peft: no PEFT model either
        return False
    return isinstance(model, peft.PeftModel)
