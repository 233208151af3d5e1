"""`deploy`: serve a model from a mesh of replicas, over HTTP and from Python.

One path: the user's arguments become a `ModelSpec` and a `ServeConfig`, the config's sections
(raymesh.serve.sections) go down to the backend's rooms, each receiving only its own, and the
started backend comes back as an `App`.
"""

from __future__ import annotations

from typing import Any

from raymesh.actor import host_mesh
from raymesh.serve.app import App
from raymesh.serve.config import ServeConfig
from raymesh.serve.model import ModelSpec
from raymesh.serve.server import Server

__all__ = ["deploy"]


def deploy(
    model: Any = None,
    *,
    build: Any = None,
    hf: str | None = None,
    checkpoint: str | None = None,
    generate: Any = None,
    input_shape: tuple[int, ...] | None = None,
    input_dtype: str | None = None,
    seed: int = 0,
    config: ServeConfig | None = None,
    **fields: Any,
) -> App:
    """Serve `model` and return once `min` replicas are ready (or raise what stopped them).

    model: an nn.Module or a `predict(batch) -> outputs` function; or give `build=` (a
        raymesh.train build function, "pkg.module:build" or the function) to build the model
        as training did; or hf= (a Hugging Face folder, as `raymesh export --hf` writes it:
        a causal LM, or an adapter naming its local base), which generates text by default
        (raymesh.train.hf.generate). checkpoint: a raymesh.train checkpoint folder (its
        newest committed step) or one step's folder, loaded into the module; given alone, the
        model is rebuilt with its job's build function, or from the transformers model it
        records (a causal LM then generates as hf= does; see `raymesh.serve.model`). generate: a
        function serving POST /v1/generate (see `raymesh.serve.model`). input_shape /
        input_dtype: one request's input, checked by the front (422 when wrong; from the
        task's first sample when a build function is given).
    config, or its fields as keywords (replicas=(1, 4), max_batch_size=32, batch_wait_ms=5,
        port=0, host, token, admin_token, checkpoint_root, tls, ...): see `ServeConfig`.
        backend="ray-serve" deploys the same model as a Ray Serve deployment instead.
    Raises ValueError for a bad argument (naming it) before starting anything.
    """
    if config is not None and fields:
        raise ValueError(f"give config= or its fields {sorted(fields)} as keywords, not both")
    config = config or ServeConfig(**fields)
    # The tokens are settled here, once (an admin token from the environment that cannot be
    # used is a ValueError now, before anything starts).
    router, batch, front = config.router, config.batch, config.front
    spec = ModelSpec(
        model=model,
        build=build,
        hf=hf,
        checkpoint=checkpoint,
        generate=generate,
        input_shape=input_shape,
        input_dtype=input_dtype,
        seed=seed,
    ).resolved()
    # Start (or join) Ray here, on the caller's thread: Ray ties the life of the processes it
    # starts to the thread that started them, and the server's thread ends with `stop()`.
    host_mesh()
    if config.backend == "ray-serve":
        from raymesh.serve import _ray_serve  # imports Ray Serve: only for this backend

        return _ray_serve.deploy(spec, replicas=router.replicas, batch=batch, front=front)
    return Server(spec, router=router, batch=batch, front=front).start()
