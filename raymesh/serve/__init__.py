"""raymesh.serve: serving a trained checkpoint from a mesh of replicas (issue 15, in progress).

Built so far, the two decisions a server makes, as plain data with no Ray and no HTTP:
- `BatchQueue` (`raymesh.serve.batching`): dynamic batching over a bounded queue;
- `AutoscalePolicy` (`raymesh.serve.scaling`): how many replicas, from queue depth, latency
  and how busy the replicas were.
The replicas, the HTTP front (Starlette under uvicorn) and `serve.deploy` are to come.
"""

from raymesh.serve.batching import BatchConfig, BatchQueue, Overloaded
from raymesh.serve.scaling import AutoscalePolicy, ReplicaScale

__all__ = ["AutoscalePolicy", "BatchConfig", "BatchQueue", "Overloaded", "ReplicaScale"]
