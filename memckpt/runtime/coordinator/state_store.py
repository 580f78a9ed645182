"""Where the coordinator's small state survives its process (:class:`StateStore`: Ray's
GCS in a job, memory in tests and the benchmark), and how a restarted coordinator proves
from the replica stores' inventories which steps were placed."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Mapping, Optional, Protocol, Union

COORDINATOR_NAMESPACE = "memckpt"

Inventory = dict[str, dict[int, list[int]]]  # node -> rank -> steps its store holds
# the stores' names (node -> actor name), a timeout -> their inventory (or an awaitable of it)
InventorySource = Callable[[Mapping[str, str], float],
                           Union[Inventory, Awaitable[Inventory]]]


class StateStore(Protocol):
    """Where the coordinator's small state survives its process."""

    def get(self) -> Optional[bytes]: ...

    def put(self, data: bytes) -> None: ...

    def delete(self) -> None: ...


class GcsStateStore:
    """The state under ``memckpt/<job>/coordinator`` in Ray's GCS key-value store."""

    def __init__(self, job: str) -> None:
        self.key = f"memckpt/{job}/coordinator".encode()

    @staticmethod
    def _kv() -> Any:
        from ray.experimental import internal_kv
        return internal_kv

    def get(self) -> Optional[bytes]:
        return self._kv()._internal_kv_get(self.key)

    def put(self, data: bytes) -> None:
        self._kv()._internal_kv_put(self.key, data, overwrite=True)

    def delete(self) -> None:
        self._kv()._internal_kv_del(self.key)


class MemoryStateStore:
    """The state in this process (a test, ``memckpt bench control-plane``): it does not
    outlive the process. Counts its writes and their bytes."""

    def __init__(self) -> None:
        self.data: Optional[bytes] = None
        self.puts = 0
        self.bytes_written = 0

    def get(self) -> Optional[bytes]:
        return self.data

    def put(self, data: bytes) -> None:
        self.data = data
        self.puts += 1
        self.bytes_written += len(data)

    def delete(self) -> None:
        self.data = None


async def ray_inventory(stores: Mapping[str, str], timeout_s: float) -> Inventory:
    """node -> rank -> steps, asked of each node's replica store by its actor name (its
    ``inventory`` method); a store that is gone or silent for ``timeout_s`` is left out."""
    import ray

    async def one(name: str) -> Any:
        return await ray.get_actor(name, namespace=COORDINATOR_NAMESPACE).inventory.remote()

    nodes = list(stores)
    got = await asyncio.gather(*(asyncio.wait_for(one(stores[n]), timeout_s) for n in nodes),
                               return_exceptions=True)
    return {n: {int(r): list(steps) for r, steps in held.items()}
            for n, held in zip(nodes, got) if isinstance(held, dict)}


def proven_ready(inventory: Inventory, assignment: Mapping[str, str],
                 holders: Mapping[str, list[str]]) -> dict[int, set[int]]:
    """step -> the ranks whose shard of it the stores prove in place: on the rank's own
    node and on all its holders (what a rank's ``shard_ready`` says). One pass over the
    ranks and their holders."""
    out: dict[int, set[int]] = {}
    for r, node in assignment.items():
        steps = set(inventory.get(node, {}).get(int(r), []))
        for h in holders.get(r, []):
            if not steps:
                break
            steps &= set(inventory.get(h, {}).get(int(r), []))
        for step in steps:
            out.setdefault(step, set()).add(int(r))
    return out
