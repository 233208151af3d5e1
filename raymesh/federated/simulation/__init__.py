"""Simulated clients: the client-host actors that carry thousands of clients as state on a few
procs and answer a round's messages for them (`host`), the pool of those procs with a lost one
replaced after its round (`host_pool`), and the non-IID split of a dataset among simulated
clients (`partition`). It stands on the protocol room and the core's actors.
"""
