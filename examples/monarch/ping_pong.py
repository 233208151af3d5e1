"""Monarch's "Ping Pong" docs example (docs/source/examples/ping_pong.py), on raymesh: the same
program with `raymesh.actor` in place of `monarch.actor` in the imports, nothing else changed.

It spawns actors on meshes of procs, calls their endpoints from the script, and has actors of
two meshes message each other.

    python examples/monarch/ping_pong.py                            # any machine
    RAYMESH_ADDRESS=<head>:6379 python examples/monarch/ping_pong.py  # a Ray cluster

An axis named `gpus` gives each raymesh proc a GPU of its own where the hosts have GPUs
(Monarch's names no resource); on hosts without GPUs it is only a name, as in Monarch, and the
procs are CPU procs.
"""

# %%
# Hello world
# -----------
# An actor is an object living in a proc; the methods marked @endpoint are the ones other
# processes may call.

from raymesh.actor import Actor, current_rank, endpoint, this_host

NUM_ACTORS = 4


class ToyActor(Actor):
    def __init__(self):
        self.rank = current_rank().rank

    @endpoint
    def hello_world(self, msg):
        print(f"Identity: {self.rank}, {msg=}")


# %%
# A mesh of 4 procs on this host, and one ToyActor on each.

local_proc_mesh = this_host().spawn_procs(per_host={"gpus": NUM_ACTORS})
toy_actor = local_proc_mesh.spawn("toy_actor", ToyActor)


# %%
# `call` reaches every actor of the mesh; `get` waits for all of them.

toy_actor.hello_world.call("hey there, from script!!").get()


# %%
# A slice picks one actor; `call_one` messages a mesh of exactly one.

futures = []
for idx in range(NUM_ACTORS):
    actor_instance = toy_actor.slice(gpus=idx)
    futures.append(actor_instance.hello_world.call_one(f"Here's an arbitrary unique value: {idx}"))

for fut in futures:
    fut.get()


# %%
# Ping pong
# ---------
# Actors can hold references to other meshes and call them too.


class ExampleActor(Actor):
    def __init__(self, actor_name):
        self.actor_name = actor_name

    @endpoint
    def init(self, other_actor):
        self.other_actor = other_actor
        self.other_actor_pair = other_actor.slice(**current_rank())
        self.identity = current_rank().rank

    @endpoint
    def send(self, msg):
        self.other_actor_pair.recv.call(f"Sender ({self.actor_name}:{self.identity}) {msg=}").get()

    @endpoint
    def recv(self, msg):
        print(f"Pong!, Receiver ({self.actor_name}:{self.identity}) received msg {msg}")


# %%
# Two meshes of two actors each; the extra spawn argument goes to ExampleActor.__init__.

local_mesh_0 = this_host().spawn_procs(per_host={"gpus": 2})
actor_0 = local_mesh_0.spawn(
    "actor_0",
    ExampleActor,
    "actor_0",
)

local_mesh_1 = this_host().spawn_procs(per_host={"gpus": 2})
actor_1 = local_mesh_1.spawn(
    "actor_1",
    ExampleActor,
    "actor_1",
)


# %%
# Each mesh gets a reference to the other; actor i talks to its peer at the same point.

actor_0.init.call(actor_1).get()
actor_1.init.call(actor_0).get()


# %%
# Messages between the meshes, both ways.

actor_0.send.call("Ping").get()
actor_1.send.call("Ping").get()

print("Example completed successfully!")
