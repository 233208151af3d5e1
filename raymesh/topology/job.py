"""A job's shape: world size, strategy (DDP, FSDP, HSDP) and tensor parallelism, and the
process groups they imply. Pure data, validated on construction.

Rank layout (torchtitan's order, TP innermost): rank = (r * shard + s) * tp + t, so a TP group is
contiguous ranks, a shard group is ranks tp apart, a replicate group ranks shard * tp apart.
DDP is replicate = world / tp, shard = 1; FSDP is replicate = 1, shard = world / tp.
"""

from __future__ import annotations

from dataclasses import dataclass

from raymesh._common import is_int
from raymesh.topology.model import GIB

__all__ = ["JobShape"]

STRATEGIES = ("ddp", "fsdp", "hsdp")
DEVICES = ("auto", "gpu", "cpu")


@dataclass(frozen=True, kw_only=True)
class JobShape:
    """A job's shape: how many ranks and how they split into process groups.

    Raises ValueError on construction for an impossible shape, showing the arithmetic.
    """

    world_size: int  # ranks (procs) in all
    strategy: str = "ddp"  # "ddp" (replicate), "fsdp" (shard), "hsdp" (replicate x shard)
    replicate: int | None = None  # HSDP only: how many replicas
    shard: int | None = None  # HSDP only: ranks each replica is sharded over
    tp: int = 1  # tensor-parallel degree; TP groups are contiguous ranks (innermost)
    memory_bytes: int = 0  # device memory one rank needs; devices with less are left out
    grad_bytes: int = GIB  # gradient bytes per step the cost is estimated for (1 GiB)
    tp_bytes: int | None = None  # bytes all-reduced per step inside a TP group (None: grad_bytes)
    device: str = "auto"  # "gpu", "cpu" (procs on CPUs), "auto": GPUs if the topology has any

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "grad_bytes"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"JobShape: {name}={value!r}; it must be an integer >= 1")
        if not is_int(self.memory_bytes) or self.memory_bytes < 0:
            raise ValueError(
                f"JobShape: memory_bytes={self.memory_bytes!r}; it must be an integer >= 0 "
                "(0: any device will do)"
            )
        if self.tp_bytes is not None and self.tp_bytes < 1:
            raise ValueError(f"JobShape: tp_bytes={self.tp_bytes!r}; use an integer >= 1 or None")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"JobShape: strategy={self.strategy!r}; use one of {list(STRATEGIES)}")
        if self.device not in DEVICES:
            raise ValueError(f"JobShape: device={self.device!r}; use one of {list(DEVICES)}")
        if self.world_size % self.tp:
            raise ValueError(
                f"JobShape: world_size({self.world_size}) % tp({self.tp}) != 0. Fix: make "
                "world_size a multiple of tp"
            )
        dp = self.world_size // self.tp
        if self.strategy == "hsdp":
            if self.replicate is None or self.shard is None:
                raise ValueError(
                    f"JobShape: strategy='hsdp' needs replicate and shard (got replicate="
                    f"{self.replicate!r}, shard={self.shard!r}). Fix: e.g. replicate=2, "
                    f"shard={max(dp // 2, 1)} for world_size={self.world_size}, tp={self.tp}"
                )
            for name in ("replicate", "shard"):
                value = getattr(self, name)
                if not is_int(value) or value < 1:
                    raise ValueError(f"JobShape: {name}={value!r}; it must be an integer >= 1")
            if self.replicate * self.shard * self.tp != self.world_size:
                raise ValueError(
                    f"JobShape: replicate({self.replicate}) * shard({self.shard}) * tp({self.tp})"
                    f" = {self.replicate * self.shard * self.tp} != world_size({self.world_size})"
                    f". Fix: choose replicate * shard = world_size / tp = {dp}"
                )
        elif self.replicate is not None or self.shard is not None:
            raise ValueError(
                f"JobShape: replicate={self.replicate!r}, shard={self.shard!r} are for "
                f"strategy='hsdp', not {self.strategy!r}. Fix: leave them unset, or use 'hsdp'"
            )

    @property
    def dims(self) -> tuple[int, int, int]:
        """(replicate, shard, tp) degrees; their product is world_size."""
        dp = self.world_size // self.tp
        if self.strategy == "ddp":
            return dp, 1, self.tp
        if self.strategy == "fsdp":
            return 1, dp, self.tp
        assert self.replicate is not None and self.shard is not None  # checked on construction
        return self.replicate, self.shard, self.tp

    def groups(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """The process groups by kind ("replicate", "shard", "tp"), as ranks.

        DDP has "replicate", FSDP "shard", HSDP both; "tp" appears when tp > 1.
        """
        rep, sh, tp = self.dims

        def rank(r: int, s: int, t: int) -> int:
            return (r * sh + s) * tp + t

        out: dict[str, tuple[tuple[int, ...], ...]] = {}
        if tp > 1:
            out["tp"] = tuple(
                tuple(rank(r, s, t) for t in range(tp)) for r in range(rep) for s in range(sh)
            )
        if self.strategy in ("fsdp", "hsdp"):
            out["shard"] = tuple(
                tuple(rank(r, s, t) for s in range(sh)) for r in range(rep) for t in range(tp)
            )
        if self.strategy in ("ddp", "hsdp"):
            out["replicate"] = tuple(
                tuple(rank(r, s, t) for r in range(rep)) for s in range(sh) for t in range(tp)
            )
        return out

    def collectives(self) -> dict[str, tuple[int, float]]:
        """Per group kind: (c, bytes) of the cost model (see the module docstring)."""
        _, sh, tp = self.dims
        per_rank = self.grad_bytes / tp  # TP splits the parameters, hence the gradients
        out: dict[str, tuple[int, float]] = {}
        if tp > 1:
            out["tp"] = (2, float(self.tp_bytes or self.grad_bytes))
        if self.strategy in ("fsdp", "hsdp"):
            out["shard"] = (3, per_rank)
        if self.strategy == "ddp":
            out["replicate"] = (2, per_rank)
        if self.strategy == "hsdp":
            out["replicate"] = (2, per_rank / sh)  # each replica group reduces one shard
        return out

    def describe(self) -> str:
        rep, sh, tp = self.dims
        dims = f" {rep}x{sh}" if self.strategy == "hsdp" else ""
        return f"{self.strategy}{dims}" + (f" x tp{tp}" if tp > 1 else "")
