"""How much host RAM memckpt holds on a node, planned from the slot layout, and the budget
it must fit in. Pure arithmetic: no Ray, no torch, no file system.

A rank's snapshot lives in two slots (the committed step and the one being written), on
its own node and on each of its ``placement.replicas`` holders. So a node holds, at its
peak, two slots for every rank it runs and two for every rank whose copy it keeps:
``2 + 2k`` times the state with ``k`` replicas, spread over the nodes. A warm spare holds
no slots (a rank it takes over adopts its replica's files, or gets its slots at the
restore, when the lost node's are gone); what it prepares for a restore comes out of the
same budget (:func:`spare_room`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

SLOTS = 2  # a committed and an in-flight copy in each place
MIN_BUDGET_BYTES = 1 << 20

# ``Config.ram_budget``: a fraction of the node's RAM (a float in (0, 1]) or bytes (an int)
RamBudget = Union[float, int]


def human_bytes(n: Optional[float]) -> str:
    """1.50 GiB, 12.0 GiB, 3.20 MiB, 512 B; "–" for None."""
    if n is None:
        return "–"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if n < 10 * scale else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


_gib = human_bytes


@dataclass(frozen=True)
class NodeFootprint:
    """What memckpt holds in host RAM on one node at its peak, from the layout."""

    shard_bytes: int  # one rank's slot file (the largest rank's, where they differ)
    own_ranks: int  # ranks the node runs
    replica_ranks: int  # ranks whose copies the node's store keeps
    slots: int = SLOTS

    def __post_init__(self) -> None:
        for name in ("shard_bytes", "own_ranks", "replica_ranks", "slots"):
            if getattr(self, name) < 0:
                raise ValueError(f"NodeFootprint.{name}={getattr(self, name)} is negative")

    @property
    def own_bytes(self) -> int:
        return self.slots * self.own_ranks * self.shard_bytes

    @property
    def replica_bytes(self) -> int:
        return self.slots * self.replica_ranks * self.shard_bytes

    @property
    def total(self) -> int:
        return self.own_bytes + self.replica_bytes

    @property
    def state_bytes(self) -> int:
        """The node's own training state (one copy of each of its ranks' shards)."""
        return self.own_ranks * self.shard_bytes

    def explain(self) -> str:
        """Where the bytes go, in words."""
        per = _gib(self.shard_bytes)
        own = (f"{self.slots} slots x {self.own_ranks} rank(s) run here x {per} = "
               f"{_gib(self.own_bytes)}")
        if not self.replica_ranks:
            return own
        return (f"{own}, plus {self.slots} slots x {self.replica_ranks} peer rank(s) whose "
                f"copies this node keeps x {per} = {_gib(self.replica_bytes)}")


def budget_bytes(ram_budget: RamBudget, total_ram: int) -> int:
    """The bytes ``ram_budget`` allows on a node with ``total_ram`` bytes of RAM."""
    if isinstance(ram_budget, float):
        return int(ram_budget * total_ram)
    return int(ram_budget)


def check_ram_budget(value: object) -> str:
    """'' when ``value`` is a valid ``ram_budget``, else what is wrong and what to pass."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "use a fraction of the node's RAM (a float in (0, 1]) or a number of bytes (an int)"
    if isinstance(value, float) and not 0.0 < value <= 1.0:
        return ("a float is a fraction of the node's RAM: use one in (0, 1], or an int for "
                "bytes (e.g. 64 << 30)")
    if isinstance(value, int) and value < MIN_BUDGET_BYTES:
        return (f"an int is bytes: use at least {MIN_BUDGET_BYTES} (1 MiB), or a float in (0, 1] "
                "for a fraction of the node's RAM")
    return ""


def over_budget(fp: NodeFootprint, budget: int, shm_free: int) -> str:
    """'' when ``fp`` fits both the budget and the shared-memory file system's free room
    (``shm_free``: what is free there now, plus what this node's slots already hold);
    else the error: the numbers, why, and the settings that lower them."""
    limit = min(budget, shm_free)
    if fp.total <= limit:
        return ""
    what = "ram_budget" if budget <= shm_free else "the free room of the shared-memory file system"
    return (
        f"memckpt would hold {_gib(fp.total)} of host RAM on this node, more than {what} "
        f"allows: {fp.explain()}. This node's state is {_gib(fp.state_bytes)}; ram_budget "
        f"allows {_gib(budget)}; the shared-memory file system has {_gib(shm_free)} free. "
        "Lower it with fewer copies (placement.replicas), fewer ranks per node "
        "(workers.workers_per_node), less state per rank (more ranks, ZeRO/FSDP sharding), "
        "or raise Config.ram_budget (a fraction of the node's RAM, or bytes) and the "
        "tmpfs size (mount -o remount,size=... /dev/shm)")


def spare_room(budget: int, held: int) -> int:
    """What a warm spare may prepare on a node whose memckpt files hold ``held`` bytes."""
    return max(0, budget - held)
