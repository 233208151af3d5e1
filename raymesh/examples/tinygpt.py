"""A tiny character-level GPT trained on the Python standard library's own source code.

Runs offline anywhere Python does: the corpus is the stdlib's `*.py` files, read as bytes.

On a laptop (4 CPU workers, 300 steps, a few minutes on 2 cores), then a sample:

    python -m raymesh.examples.tinygpt
    python -m raymesh.examples.tinygpt --workers 2 --steps 100

On a cluster (one GPU per worker when the cluster has GPUs), or from a job file whose
`build = "raymesh.examples.tinygpt:build"`:

    python -m raymesh.examples.tinygpt --workers 8 --steps 2000 --batch 256
    raymesh train job.toml

The model is nanoGPT's shape at toy size: token + position embeddings, `n_layer` pre-LayerNorm
blocks (causal self-attention, MLP), a final LayerNorm and an lm head tied to the token
embedding. `TinyGPT.blocks` is an nn.ModuleList, so FSDP shards it block by block.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import hashlib
import math
import os
import sysconfig
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from raymesh.examples import on_compute_device
from raymesh.train import Context, Task

__all__ = [
    "CharDataset",
    "TinyGPT",
    "build",
    "generate",
    "generate_bytes",
    "lm_loss",
    "serve_text",
    "stdlib_corpus",
]

# The default config: ~0.12M parameters, trains visibly on a 2-core CPU in minutes.
BLOCK_SIZE = 64  # context length in bytes
N_LAYER = 2
N_HEAD = 4
N_EMBD = 64
LR = 3e-3
MAX_BYTES = 1 << 20  # corpus size: 1 MiB of stdlib source


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} must be divisible by n_head={n_head}")
        self.n_head = n_head
        self.dropout = dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
            for z in self.qkv(x).split(c, dim=2)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        out: torch.Tensor = self.resid_drop(self.proj(y))
        return out


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT over bytes: `forward(idx[B, T]) -> logits[B, T, vocab]`, T <= block_size.

    Initialisation draws from torch's global RNG (raymesh seeds it before `build`), so the same
    seed gives the same weights on every rank.
    """

    def __init__(
        self,
        vocab: int = 256,
        block_size: int = BLOCK_SIZE,
        n_layer: int = N_LAYER,
        n_head: int = N_HEAD,
        n_embd: int = N_EMBD,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.vocab = vocab
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab, n_embd)
        self.pos_emb = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # weight tying: one matrix, counted once
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps the residual stream's variance
        # from growing with depth.
        for name, p in self.named_parameters():
            if name.endswith("attn.proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))
        return logits


def _skip_dir(name: str) -> bool:
    # Test suites are mostly fixtures, not idiomatic code; site-packages holds whatever this
    # machine installed, which would make the corpus differ between machines.
    return name in ("test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__")


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = MAX_BYTES) -> bytes:
    """Up to `max_bytes` of the standard library's `*.py` source, concatenated.

    Deterministic: directories and files are visited in sorted order (depth first, a folder's
    files before its subfolders), skipping test suites, installed packages and unreadable
    files. The same Python version and build gives the same bytes on every machine; a
    different version (or a distribution that patches the stdlib) gives a different corpus.
    """
    root = sysconfig.get_paths()["stdlib"]
    parts: list[bytes] = []
    size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not _skip_dir(d))  # in place: prunes walk
        for name in sorted(f for f in filenames if f.endswith(".py")):
            try:
                with open(os.path.join(dirpath, name), "rb") as f:
                    data = f.read(max_bytes - size)
            except OSError:
                continue
            parts.append(data)
            size += len(data)
            if size >= max_bytes:
                return b"".join(parts)
    return b"".join(parts)


class CharDataset(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Windows of stdlib source bytes: item i = (x, y), int64 tensors of `block_size` bytes,
    y = x shifted by one byte.

    Window i starts at byte i * stride (default stride = block_size: windows do not overlap,
    so one pass over the dataset reads the corpus once). Identical on every rank and machine
    with the same Python version (see `stdlib_corpus`); `digest` fingerprints the corpus so
    ranks can check that.
    """

    def __init__(self, block_size: int, max_bytes: int = MAX_BYTES, stride: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        stride = block_size if stride is None else stride
        if stride < 1:
            raise ValueError(f"stride={stride}: must be >= 1")
        corpus = stdlib_corpus(max_bytes)
        if len(corpus) < block_size + 1:
            raise ValueError(
                f"the stdlib corpus has {len(corpus)} bytes, fewer than block_size + 1 = "
                f"{block_size + 1} (is the stdlib source at {sysconfig.get_paths()['stdlib']!r}?)"
                f"; raise max_bytes={max_bytes} or lower block_size"
            )
        self.block_size = block_size
        self.stride = stride
        self.digest = hashlib.sha256(corpus).hexdigest()[:16]
        self.data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
        self._len = (len(corpus) - block_size - 1) // stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not -self._len <= i < self._len:
            raise IndexError(f"index {i} out of range for {self._len} windows")
        start = (i % self._len) * self.stride
        chunk = self.data[start : start + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def lm_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Mean next-byte cross-entropy of `model` on a batch (x, y) of [B, T] byte tensors."""
    x, y = batch
    logits = model(on_compute_device(model, x))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.to(logits.device).reshape(-1))


def build(ctx: Context) -> Task:
    """The default job: TinyGPT (~0.12M params) with AdamW on 1 MiB of stdlib source."""
    model = TinyGPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.99), weight_decay=0.01)
    dataset = CharDataset(block_size=model.block_size)
    return Task(
        model=model,
        optimizer=optimizer,
        dataset=dataset,
        loss_fn=lm_loss,
        extra={"corpus_digest": dataset.digest},
    )


def generate(
    model: nn.Module,
    prompt: bytes,
    n: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> bytes:
    """`prompt` followed by `n` generated bytes from a TinyGPT.

    temperature 0 is greedy (deterministic); above 0 samples from softmax(logits / temperature)
    with `generator` (pass a seeded one for a reproducible sample). Needs an unsharded model
    (a DDP-wrapped one is unwrapped); an empty prompt starts from a newline. The model's
    training mode is restored afterwards.
    """
    return (prompt or b"\n") + b"".join(generate_bytes(model, prompt, n, temperature, generator))


@torch.no_grad()
def generate_bytes(
    model: nn.Module,
    prompt: bytes,
    n: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> Iterator[bytes]:
    """The `n` bytes `generate` appends to `prompt`, one at a time, as each is made."""
    if n < 0:
        raise ValueError(f"n={n}: must be >= 0")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: must be >= 0 (0 is greedy)")
    inner = getattr(model, "module", model)  # DistributedDataParallel keeps it in .module
    if not isinstance(inner, TinyGPT):
        raise TypeError(f"generate needs a TinyGPT (or a DDP-wrapped one), not {type(inner)}")
    block_size = inner.block_size
    device = next(inner.parameters()).device
    idx = torch.tensor([list(prompt or b"\n")], dtype=torch.long, device=device)
    was_training = inner.training
    inner.eval()
    try:
        for _ in range(n):
            logits = inner(idx[:, -block_size:])[:, -1, :]
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits.float() / temperature, dim=-1).cpu()
                nxt = torch.multinomial(probs, 1, generator=generator).to(device)
            idx = torch.cat([idx, nxt], dim=1)
            yield bytes([int(nxt)])
    finally:
        inner.train(was_training)


def serve_text(
    model: nn.Module, prompt: str, max_tokens: int, temperature: float, seed: int
) -> Iterator[str]:
    """raymesh.serve's generate function for TinyGPT (`generate = "raymesh.examples.tinygpt:
    serve_text"` in a job file's [serve] table): up to `max_tokens` bytes after `prompt`, as
    text. A byte that ends no UTF-8 character yields "" (still one token), so the tokens
    counted are the bytes made; sampling is seeded with `seed`."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    generator = torch.Generator().manual_seed(seed)
    for byte in generate_bytes(model, prompt.encode(), max_tokens, temperature, generator):
        yield decoder.decode(byte)


def main(argv: list[str] | None = None) -> None:
    """Train with raymesh, print the loss every few steps, then a sample."""
    from raymesh import train

    p = argparse.ArgumentParser(description="Train TinyGPT on the stdlib's source with raymesh.")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences per step)")
    p.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp", "hsdp"])
    p.add_argument("--shard-size", type=int, default=None, help="HSDP: ranks per shard group")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    config = train.TrainConfig(
        workers=args.workers,
        steps=args.steps,
        global_batch_size=args.batch,
        strategy=args.strategy,
        shard_size=args.shard_size,
        seed=args.seed,
        report_every=10,
    )
    # By name, not `build` itself: run as a script, this module is __main__, which the trainer
    # procs cannot import.
    result = train.fit("raymesh.examples.tinygpt:build", config)
    print(result.decision.reason)
    every = max(1, len(result.history) // 10)
    for i, h in enumerate(result.history):
        if h["loss"] is not None and (i % every == 0 or i == len(result.history) - 1):
            print(f"step {int(h['step']):5d}  loss {h['loss']:.3f}")
    model = TinyGPT()
    model.load_state_dict(result.state_dict())
    # Sampled, not greedy: a model this small repeats its likeliest word when greedy.
    sample = generate(
        model, b"def ", 300, temperature=0.8, generator=torch.Generator().manual_seed(0)
    )
    print(sample.decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
