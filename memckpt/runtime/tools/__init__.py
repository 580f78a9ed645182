"""Operator tools beside the processes: a local multi-node cluster and the client that finds
a running job's coordinator (fault injection, which runs inside the job's own processes,
is :mod:`memckpt.runtime.chaos`)."""
