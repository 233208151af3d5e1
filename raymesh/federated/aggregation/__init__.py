"""The server's side of a round: how clients are sampled and how their mean update becomes the
next global model (`strategy`), secure aggregation's server side that unmasks only the sum
(`secagg_server`), and the four steps of a secure round driven over its targets, procs and
edge clients alike (`secure_round`). Nothing here is copied to a device.
"""
