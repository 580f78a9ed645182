"""Operator tools beside the processes: fault injection, a local multi-node cluster, the
client that finds a running job's coordinator."""
