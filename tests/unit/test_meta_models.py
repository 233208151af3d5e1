"""Models built on the meta device: probed for memory without a byte of them existing, made
real where they are used, and filled from pretrained safetensors with each rank reading only
its own shards (`raymesh.train.materialize`, `raymesh.train.hf.PretrainedWeights`)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("accelerate")

from raymesh.train import Task
from raymesh.train.estimate import probe_activation_bytes
from raymesh.train.hf import (
    Lora,
    PretrainedWeights,
    causal_lm_loss,
    load_causal_lm,
    save_tiny_llama,
)
from raymesh.train.materialize import materialize, on_meta
from raymesh.train.rank.full_state import full_state

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")
LORA = Lora(r=4, targets=("q_proj", "v_proj"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # 4 blocks, so FSDP has units to shard and the shards are worth counting.
    return save_tiny_llama(tmp_path_factory.mktemp("m") / "llama", layers=4, hidden_size=64)


@pytest.mark.parametrize("lora", [None, LORA], ids=["full", "lora"])
def test_the_probe_of_a_meta_model_measures_what_the_real_one_saves(
    folder: Path, lora: Lora | None
) -> None:
    real = load_causal_lm(folder, lora=lora)
    meta = load_causal_lm(folder, lora=lora, meta=True)
    assert on_meta(meta) and not on_meta(real)
    batch = torch.randint(0, 256, (1, 64))
    for dtype in (None, torch.bfloat16):  # autocast too, which meta tensors alone skip
        want = probe_activation_bytes(real, causal_lm_loss, batch, autocast=dtype)
        got = probe_activation_bytes(meta, causal_lm_loss, batch, autocast=dtype)
        # Without values, transformers keeps the causal mask it drops when it can see it
        # needs none, and repeats the KV heads for it: a little more, never less.
        assert 0 < want <= got <= 1.2 * want, (dtype, got, want)
    assert on_meta(meta)  # the probe allocated nothing in its place


def test_a_meta_model_filled_on_one_rank_is_the_saved_model_and_starts_at_its_base(
    folder: Path,
) -> None:
    real = load_causal_lm(folder)
    meta = load_causal_lm(folder, lora=LORA, meta=True)
    materialize(meta, CPU, PretrainedWeights(folder, seed=3))
    assert not on_meta(meta)
    base = meta.get_base_model()
    x = torch.randint(0, 256, (2, 32))
    with torch.no_grad():  # LoRA's B starts at zero: the adapted model is its base
        assert torch.equal(real(input_ids=x).logits, meta(input_ids=x).logits)
    want = real.state_dict()
    for name, t in base.state_dict().items():
        key = name.replace(".base_layer.", ".")
        if "lora_" not in name:
            assert torch.equal(t, want[key]), name
    a = [t for n, t in meta.named_parameters() if "lora_A" in n]
    assert a and all(t.abs().sum() > 0 for t in a)  # drawn, not left empty


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CPU offload)")
def test_offloaded_params_are_allocated_in_host_memory_and_buffers_on_the_gpu(
    folder: Path,
) -> None:
    # FSDP2's CPU offload keeps shards on the CPU: allocated on the GPU, loading failed there.
    meta = load_causal_lm(folder, meta=True)
    materialize(meta, torch.device("cuda", 0), PretrainedWeights(folder), params_on=CPU)
    assert {p.device.type for p in meta.parameters()} == {"cpu"}
    assert {b.device.type for b in meta.buffers()} <= {"cuda"}
    want = load_causal_lm(folder).state_dict()
    assert all(torch.equal(t.cpu(), want[n]) for n, t in meta.state_dict().items())


def test_the_examples_losses_keep_a_placed_batch_where_it_is_and_move_a_cpu_one() -> None:
    # Under CPU offload the parameters' device (the CPU) is not where the forward runs: a
    # batch fit placed on ctx.device must stay there. Meta stands in for the GPU here.
    from raymesh.examples import on_compute_device

    model = torch.nn.Linear(2, 2)
    placed = torch.ones(2, 2, device="meta")
    assert on_compute_device(model, placed) is placed
    assert on_compute_device(model.to("meta"), torch.ones(2, 2)).is_meta


def test_a_meta_model_needs_init_weights_and_the_folder_of_its_own_weights(
    folder: Path, tmp_path: Path
) -> None:
    meta = load_causal_lm(folder, meta=True)
    opt = torch.optim.AdamW(meta.parameters())
    with pytest.raises(ValueError, match=r"Task\.init_weights=None"):
        Task(model=meta, optimizer=opt, loss_fn=causal_lm_loss)
    with pytest.raises(TypeError, match=r"Task\.model=str: give a torch\.nn\.Module"):
        Task(model="llama", optimizer=opt, loss_fn=causal_lm_loss)  # type: ignore[arg-type]
    other = save_tiny_llama(tmp_path / "other", layers=2, hidden_size=64)
    with pytest.raises(ValueError, match=r"no weight for .* model\.layers\.2"):
        materialize(meta, CPU, PretrainedWeights(other))
    with pytest.raises(ValueError, match=r"no \*\.safetensors"):
        materialize(load_causal_lm(folder, meta=True), CPU, PretrainedWeights(tmp_path))


def _rank(rank: int, world: int, folder: str, store: str, out: str) -> None:
    """One FSDP rank: shard the meta model, fill it, report its shards and what it read."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.fsdp import fully_shard

    from raymesh.train.estimate import fsdp_blocks

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    read = [0]
    original = dcp.HuggingFaceStorageReader.read_data

    def counting(self, plan, planner):  # type: ignore[no-untyped-def]
        for item in plan.items:  # the elements this rank asked the files for
            read[0] += int(torch.Size(item.lengths).numel())
        return original(self, plan, planner)

    dcp.HuggingFaceStorageReader.read_data = counting  # type: ignore[method-assign]
    model = load_causal_lm(folder, lora=LORA, meta=True)
    for block in fsdp_blocks(model):
        fully_shard(block)
    fully_shard(model)
    materialize(model, CPU, PretrainedWeights(Path(folder), seed=3))
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective
    local = sum(p.to_local().numel() for p in model.parameters())
    # What a learner publishes: the full state on rank 0, one gather per dtype (collective)
    adapters = {n for n in full if "lora_" in n}
    published = full_state(model, sharded=True), full_state(model, sharded=True, names=adapters)
    saved = {"full": full, "read": read[0], "local": local, "published": published}
    torch.save(saved, f"{out}/{rank}.pt")
    dist.destroy_process_group()


def test_two_fsdp_ranks_each_read_only_their_shards_and_together_hold_the_model(
    folder: Path,
) -> None:
    with tempfile.TemporaryDirectory() as out:
        store = os.path.join(out, "store")
        mp.start_processes(_rank, args=(2, str(folder), store, out), nprocs=2, start_method="spawn")
        got = [torch.load(f"{out}/{r}.pt") for r in range(2)]
    one = load_causal_lm(folder, lora=LORA, meta=True)
    materialize(one, CPU, PretrainedWeights(folder, seed=3))  # the same, unsharded
    want = dict(one.named_parameters())
    stored = sum(t.numel() for n, t in want.items() if "lora_" not in n)
    for g in got:
        assert set(g["full"]) == set(want)
        for name, t in g["full"].items():  # base weights from the file, adapters from the seed
            assert torch.equal(t, want[name]), name
        # About half of the file each (FSDP pads uneven dim-0 splits): never all of it.
        assert g["read"] <= 0.55 * stored, (g["read"], stored)
        assert g["local"] <= 0.55 * sum(t.numel() for t in want.values())
    assert sum(g["read"] for g in got) == stored
    # Gathered in one message per dtype, the full state is the same tensors, on rank 0 only;
    # only the adapters when asked for them.
    whole, adapters = got[0]["published"]
    assert got[1]["published"] == (None, None)
    assert set(adapters) == {n for n in want if "lora_" in n} and adapters
    for name, t in want.items():
        assert torch.equal(whole[name], t), name
        assert name not in adapters or torch.equal(adapters[name], t), name
