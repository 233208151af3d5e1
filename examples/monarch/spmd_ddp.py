"""Monarch's "DDP using SPMDActor" docs example (docs/source/examples/ddp/spmd_ddp.py), on
raymesh: the same program with `raymesh` in place of `monarch` in the imports, nothing else
changed. It runs `train.py` (Monarch's torchrun script, beside it, unchanged) on 4 procs.

    python examples/monarch/spmd_ddp.py          # a host with 4 GPUs (the script uses NCCL)

`SPMDActor` sets torchrun's environment on each proc (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) and runs the script as `__main__`, as `torchrun --nproc-per-node 4 train.py` would.
Differences: raymesh's `get_host_port` returns a port whose rendezvous store rank 0's actor
already holds, so no other socket can take it first (Monarch probes a free port and closes it).
Monarch's `train.py` needs 4 GPUs; on a CPU machine the same program runs a copy of it that
uses gloo and CPU tensors (tests/integration/test_monarch_examples.py makes that copy).
"""

# %%
# Imports
# -------
# We import Monarch's actor API and SPMDActor.

import os

from raymesh.actor import this_host
from raymesh.spmd import SPMDActor

GPUS_PER_HOST = 4

# Get absolute path to train.py (in the same directory as this script)
SCRIPT_DIR = os.path.dirname(os.path.abspath(__file__))
TRAIN_SCRIPT = os.path.join(SCRIPT_DIR, "train.py")


# %%
# Create Process Mesh
# -------------------
# Spawn a process mesh on the local host with 4 GPU processes.

local_proc_mesh = this_host().spawn_procs(per_host={"gpus": GPUS_PER_HOST})


# %%
# Run DDP Training with SPMDActor
# -------------------------------
# Spawn ``SPMDActor`` on the process mesh. The actor configures torch elastic
# environment variables (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)
# and executes the training script.

spmd_actors = local_proc_mesh.spawn("_SPMDActor", SPMDActor)

# Get master address/port from first actor (all coordinates = 0)
first_values = dict.fromkeys(local_proc_mesh._labels, 0)
master_addr, master_port = spmd_actors.slice(**first_values).get_host_port.call_one(None).get()

# Execute training script across the mesh
spmd_actors.main.call(master_addr, master_port, [TRAIN_SCRIPT]).get()

print("DDP example completed successfully!")
