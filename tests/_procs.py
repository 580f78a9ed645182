"""Multi-rank test jobs in fresh processes that start in a fraction of a second.

Every rank is a new process, as with ``torch.multiprocessing.spawn``, but forked from a fork
server that imported torch (and ``torch._dynamo``, which the first optimizer imports) once
for the whole session: a spawned rank spent ~5 CPU-s importing them, a forked one shares
the server's pages. The server is single-threaded and runs no torch op, so forking it is
safe. A rank is still a fresh interpreter for the job: its module is imported in the child,
under the environment the test has at the call (a fork server's children would otherwise
inherit the server's, fixed when it started).
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

import torch.multiprocessing as mp

from memckpt.util.netutil import free_port

PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.checkpoint",
           "torch.distributed.fsdp", "torch.distributed.tensor.parallel"]


def _call(rank: int, env: dict[str, str], module: str, name: str, *args: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    getattr(importlib.import_module(module), name)(rank, *args)


def spawn(fn: Callable[..., None], world: int, *args: Any) -> None:
    """``fn(rank, world, port, *args)`` on ``world`` processes, as
    ``torch.multiprocessing.start_processes`` with ``join=True``: a rank's exception is raised
    here. ``fn`` must be a module's top-level function. ``port``, for the ranks' rendezvous,
    is free when picked but another process may take it before rank 0 listens: then again."""
    mp.set_forkserver_preload(PRELOAD)  # read once, when the server starts
    for attempt in range(3):
        try:
            mp.start_processes(_call, args=(dict(os.environ), fn.__module__, fn.__qualname__,
                                            world, free_port()) + args,
                               nprocs=world, join=True, start_method="forkserver")
            return
        except mp.ProcessRaisedException as e:
            if "EADDRINUSE" not in str(e) or attempt == 2:
                raise
