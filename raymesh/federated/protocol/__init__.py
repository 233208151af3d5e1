"""The protocol of a federated round: the typed messages the controller sends and the answers
clients give (`messages`), the client's side that answers them (`client`: its model, data and
training; `privacy`: clipping for client-level DP; `secagg`: secure aggregation's crypto and
the client's masking; `shamir`: the secret sharing it uses, NumPy over GF(2**31 - 1)), and
what a valid answer looks like (`checks`). It is the lowest room:
it imports nothing else of raymesh, and all but `checks` is what an edge device copies and runs
with only torch, NumPy and the crypto libraries (their imports are relative for that reason).
"""
