"""Monarch's "Getting Started" docs example (docs/source/examples/getting_started.py), on
raymesh: the same program with `raymesh` in place of `monarch` in the imports (and so in
`raymesh.actor.unhandled_fault_hook = ...`, which names the module it imported).

    python examples/monarch/getting_started.py                            # any machine
    RAYMESH_ADDRESS=<head>:6379 python examples/monarch/getting_started.py  # a Ray cluster
    MONARCH_HOSTS=2 RAYMESH_ADDRESS=<head>:6379 python ...                  # 2 of its hosts

An axis named `gpus` gives each raymesh proc a GPU of its own where the hosts have GPUs
(Monarch's names no resource); on hosts without GPUs it is only a name, as in Monarch.
`hosts_from_config("MONARCH_HOSTS")` is the Ray cluster's hosts (Monarch's stand-in starts two
local worker processes as "hosts"), so on one machine `hosts` has one host.

Left out, each where it stood, because raymesh has no counterpart:
- "Point-to-Point RDMA" (`monarch.rdma.RDMABuffer`);
- "Distributed Tensors" (`ProcMesh.activate`, `fetch_shard`, the `rref` adverb, and the call
  that passes a distributed tensor to the trainers): Monarch's tensor engine;
- "Free Remote Functions" (`monarch.remote`, called under `activate`) and the half of
  "Channels and Low-level messaging" that sends such a function's replies to a port
  (`monarch.actor.send` under `activate`): the tensor engine again;
- "Responding Out of Order": its actor starts a non-daemon thread that loops forever in the
  script's own process (`this_proc()`), and Python waits for such a thread at exit, so the
  script would never end (Monarch's docs build does not run its examples: `plot_gallery` is
  off).
"""

# ruff: noqa: E402  (imports stand in each section, where Monarch's example has them)

# %%
# Defining an actor
# -----------------
# An actor is a Python object whose @endpoint methods other processes can call; their replies
# come back as futures.

from raymesh.actor import Actor, endpoint, this_proc


class Counter(Actor):
    def __init__(self, initial_value: int):
        self.value = initial_value

    @endpoint
    def increment(self) -> None:
        self.value += 1

    @endpoint
    def get_value(self) -> int:
        return self.value


# %%
# Spawning an actor in this process
# ---------------------------------

counter: Counter = this_proc().spawn("counter", Counter, initial_value=0)

# %%
# Sending a message: `call_one` messages the one actor; the reply is a Future.

from raymesh.actor import Future

fut: Future[int] = counter.get_value.call_one()
value: int = fut.get()

print(f"Counter value: {value}")

# %%
# Meshes of actors
# ----------------
# A mesh is a multidimensional array of procs (or actors) with named axes.

from raymesh.actor import ProcMesh, this_host

procs: ProcMesh = this_host().spawn_procs(per_host={"gpus": 8})
counters: Counter = procs.spawn("counters", Counter, 0)

# %%
# `broadcast` sends to every actor and returns nothing to wait on.

counters.increment.broadcast()

# %%
# Slices message part of a mesh (gpus 0 to 3 here).

counters.slice(gpus=slice(0, 4)).increment.broadcast()

# %%
# `call` sends to every actor and gathers their replies.
print(counters.get_value.call().get())

# %%
# Multiple hosts
# --------------
# The job's hosts come from configuration; a host mesh spawns procs on each of them.

from raymesh.actor import HostMesh, context, hosts_from_config

hosts: HostMesh = hosts_from_config("MONARCH_HOSTS")
print(hosts.extent)


class Trainer(Actor):
    @endpoint
    def step(self):
        my_point = context().message_rank
        return f"Trainer {my_point} taking a step."


trainer_procs: ProcMesh = hosts.spawn_procs(per_host={"gpus": 4})
print(f"Process mesh extent: {trainer_procs.extent}")

trainers = trainer_procs.spawn("trainer", Trainer)

print(trainers.step.call().get())

# %%
# Logging: stream every proc's output to the script, aggregated over a window.

import asyncio

asyncio.run(procs.logging_option(stream_to_client=True, aggregate_window_sec=3))

# %%
# Actor and process references
# ----------------------------
# Meshes are values: pass one to other actors, which then call it themselves.


class DataLoader(Actor):
    def __init__(self):
        self.i = 0

    @endpoint
    def example(self):
        self.i += 1
        return f"<fake data {self.i}>"


class Trainer(Actor):
    def __init__(self, dataloader: DataLoader):
        my_rank = context().actor_instance.rank
        self.dataloader = dataloader.slice(**my_rank)

    @endpoint
    def step(self, input=None):
        data = self.dataloader.example.call_one().get()
        return f"Step with data {data} and input = {input}"


dataloaders = trainer_procs.spawn("dataloader", DataLoader)
dtrainers = trainer_procs.spawn("dtrainers", Trainer, dataloaders)
print(dtrainers.step.call().get())

# %%
# The supervision tree
# --------------------
# An error in an endpoint goes back to the caller that waits for the reply.


class Errorful(Actor):
    @endpoint
    def say_hello(self):
        raise Exception("I don't want to")


e = this_proc().spawn("errorful", Errorful)
try:
    e.say_hello.call_one().get()
except Exception:
    print("It didn't say hello")

# %%
# Without a reply (`broadcast`), it goes to the owner of `e` instead.

if False:
    e.say_hello.broadcast()

# %%
# An owner that defines __supervise__ handles the failures of the meshes it spawned.

from raymesh.actor import MeshFailure


class SupervisorActor(Actor):
    def __supervise__(self, failure: MeshFailure):
        print(f"Failure received: {failure}")
        return True


# %%
# What nobody handles reaches the script's unhandled_fault_hook.

import raymesh.actor


def my_unhandled_fault_hook(failure: MeshFailure) -> None:
    print(f"Mesh failure was not handled: {failure}")


raymesh.actor.unhandled_fault_hook = my_unhandled_fault_hook

# %%
# (Monarch's "Point-to-Point RDMA" and "Distributed Tensors" sections stand here.)

# %%
# Actor context
# -------------
# `context()` says which actor runs the code, and where the current message was sent.


class ContextAwareActor(Actor):
    @endpoint
    def get_context_info(self):
        actor_instance = context().actor_instance
        message_rank = context().message_rank
        return f"Actor rank: {actor_instance.rank}, message rank: {message_rank}"


c = trainer_procs.spawn("context_actor", ContextAwareActor)
print(c.get_context_info.call().get())

# %%
# (Monarch's "Free Remote Functions" section stands here.)

# %%
# Channels and low-level messaging
# --------------------------------
# A channel is a Port to send on and a receiver to read from; a Port can be sent to actors.

from raymesh.actor import Channel, Port  # noqa: F401  (Port: in a part left out)

port, recv = Channel.open()

port.send(3)
print(recv.recv().get())

# %%
# (The rest of this section, and "Responding Out of Order", stand here in Monarch's.)
