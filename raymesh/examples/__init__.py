"""Small, offline training examples for `raymesh.train`: each module has a `build(ctx) -> Task`.

- `raymesh.examples.tinygpt`: a character-level GPT on the Python standard library's source.
- `raymesh.examples.mlp`: MLPs on synthetic data (tests, the strategy choice, the benchmark).
"""
