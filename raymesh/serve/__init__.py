"""raymesh.serve: serve a trained model over HTTP from a mesh of replicas, with dynamic batching.

    from raymesh import serve
    app = serve.deploy(build="raymesh.examples.mlp:build", checkpoint="runs/mlp",
                       replicas=(1, 4), max_batch_size=32, batch_wait_ms=5)
    app.url, app.predict.call_one(x).get(), app.reload("runs/mlp2"), app.stop()

or `raymesh serve job.toml`. Replicas are actors on procs of their own, loading the model with the
build function that trained it. The front is a Starlette app under uvicorn, in the controller's
process; requests are coalesced into batches (`BatchQueue`), the queue is bounded (503 with
Retry-After), replicas scale between min and max (`AutoscalePolicy`), and a replica that dies
has its requests resent to another. See docs/serve.md.
"""

try:
    import starlette  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # pragma: no cover (the dev install has them)
    raise ImportError(f"raymesh.serve needs {e.name}: pip install 'raymesh[serve]'") from e

from raymesh._common import Tls
from raymesh.serve.api import deploy
from raymesh.serve.app import App, Reply
from raymesh.serve.batching import BatchConfig, BatchQueue, Overloaded
from raymesh.serve.config import ADMIN_TOKEN_ENV, TOKEN_ENV, ServeConfig
from raymesh.serve.jobfile import load_serving
from raymesh.serve.model import ModelSpec
from raymesh.serve.routing.dispatcher import ModelError, Unavailable
from raymesh.serve.scaling import AutoscalePolicy, ReplicaScale

__all__ = [
    "ADMIN_TOKEN_ENV",
    "TOKEN_ENV",
    "App",
    "AutoscalePolicy",
    "BatchConfig",
    "BatchQueue",
    "ModelError",
    "ModelSpec",
    "Overloaded",
    "ReplicaScale",
    "Reply",
    "ServeConfig",
    "Tls",
    "Unavailable",
    "deploy",
    "load_serving",
]
