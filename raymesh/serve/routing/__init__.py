"""The router and its replicas: requests coalesced into batches by the `BatchQueue` and sent to
the pool's free replicas (`dispatcher`, `pool`), each replica an actor on a proc of its own
holding the model (`replica`); the pool scaled by `AutoscalePolicy`'s decisions (`autoscaler`)
and moved to new weights with no failed request (`reloader`); `router` is the one front over
them. The policies themselves (`raymesh.serve.batching`, `raymesh.serve.scaling`) are plain
data a config names, one floor down."""
