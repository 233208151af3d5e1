"""Small, offline training examples for `raymesh.train`: each module has a `build(ctx) -> Task`.

- `raymesh.examples.tinygpt`: a character-level GPT on the Python standard library's source.
- `raymesh.examples.mlp`: MLPs on synthetic data (tests, the strategy choice, the benchmark).
- `raymesh.examples.fedmlp`: the federated anchors' task (`client_fn`).

Why two examples folders: these are modules of the package, because job files name them
("raymesh.examples.tinygpt:build") and every rank imports them, from a checkout or an installed
wheel alike. The repository's `examples/` holds what a user runs or copies from a checkout: job
files (`examples/tinygpt.toml`, the README's main job) and scripts (`examples/counters.py`,
Monarch's docs examples), which are not importable and not shipped.
"""

import torch


def on_compute_device(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x` where `model`'s forward runs. A batch already off the CPU stays: fit's ranks place
    batches on `ctx.device`, and under CPU offload the parameters' device (the CPU) is not
    where the forward runs. A CPU batch (a caller's own) moves to the parameters' device."""
    if x.device.type != "cpu":
        return x
    return x.to(next(model.parameters()).device)
