"""A generation's process-group rendezvous, in the worker processes.

Rank 0's worker hosts the generation's ``TCPStore`` from the moment the driver asks for its
address (:func:`host`): the store binds port 0, so the OS picks a port no other process
holds and the worker listens on it at once. A port found free by probing and bound later
leaves a window in which any process on the node (another job's, another local cluster's)
can take it, and the generation then fails to start. The other ranks join it as clients
(:func:`join`).
"""

from __future__ import annotations

import datetime
from typing import Optional

import torch.distributed as dist


def host(ip: str, timeout: datetime.timedelta) -> dist.TCPStore:
    """A store listening now, on a port the OS chose (``store.port``), reachable at ``ip``."""
    return dist.TCPStore(ip, 0, is_master=True, wait_for_workers=False, timeout=timeout)


def join(master: tuple[str, int], rank: int, held: Optional[dist.TCPStore],
         timeout: datetime.timedelta) -> dist.Store:
    """The store rank ``rank`` makes its process group with: the one this worker hosts
    (``held``) when it is rank 0 of that rendezvous, else a client of ``master``. A rank 0
    that holds none (a caller that chose the port itself) hosts it at ``master``'s port."""
    if rank == 0 and held is not None and held.port == master[1]:
        store: dist.Store = held
    else:
        store = dist.TCPStore(master[0], master[1], is_master=rank == 0,
                              wait_for_workers=False, timeout=timeout)
    store.set_timeout(timeout)
    return store
