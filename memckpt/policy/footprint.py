"""How much host RAM memckpt holds on a node, planned from the slot layout, and the budget
it must fit in. Pure arithmetic: no Ray, no torch, no file system.

A rank's snapshot lives in two slots (the committed step and the one being written), on
its own node and on each of its ``placement.replicas`` holders. So a node holds, at its
peak, two slots for every rank it runs and two for every rank whose copy it keeps, each
of that rank's own size (ranks differ: a pipeline stage, an uneven FSDP layout, rank 0's
extra state): ``2 + 2k`` times the state with ``k`` replicas, spread over the nodes.
After a resize or a move, the layout before stays as the fallback until the new one
commits a step: the node then holds the new layout's slots plus the old files it does not
reuse (``kept``), up to ``4 + 4k`` times the state in that window. A warm spare holds
no slots (a rank it takes over adopts its replica's files, or gets its slots at the
restore, when the lost node's are gone); what it prepares for a restore comes out of the
same budget (:func:`spare_room`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence, Union

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
    """What memckpt holds in host RAM on one node at its peak, from the layout: two slots of
    each rank it runs (``own``: their slot sizes) and of each rank whose copy its store keeps
    (``copies``), plus ``kept``: the files of an earlier layout the node still holds (after
    a resize or a move they are the fallback, freed once the new layout commits a step)."""

    own: tuple[int, ...]  # the slot bytes of each rank the node runs
    copies: tuple[int, ...] = ()  # the slot bytes of each rank whose copies the node keeps
    kept: int = 0  # bytes of an earlier layout's files that stay until the new one commits
    slots: int = SLOTS

    def __post_init__(self) -> None:
        for name, values in (("own", self.own), ("copies", self.copies),
                             ("kept", (self.kept,)), ("slots", (self.slots,))):
            if any(v < 0 for v in values):
                raise ValueError(f"NodeFootprint.{name}={getattr(self, name)} is negative")

    @classmethod
    def even(cls, shard_bytes: int, own_ranks: int, replica_ranks: int,
             kept: int = 0) -> "NodeFootprint":
        """Every rank's slot ``shard_bytes`` (one process, or sizes not exchanged)."""
        return cls((shard_bytes,) * own_ranks, (shard_bytes,) * replica_ranks, kept)

    @classmethod
    def of(cls, sizes: Mapping[int, int], own: Iterable[int], copies: Iterable[int],
           kept: int = 0) -> "NodeFootprint":
        """From every rank's slot bytes (``sizes``: rank -> bytes) and the ranks the node
        runs (``own``) and keeps copies of (``copies``)."""
        return cls(tuple(sizes[r] for r in own), tuple(sizes[r] for r in copies), kept)

    @property
    def own_ranks(self) -> int:
        return len(self.own)

    @property
    def replica_ranks(self) -> int:
        return len(self.copies)

    @property
    def own_bytes(self) -> int:
        return self.slots * sum(self.own)

    @property
    def replica_bytes(self) -> int:
        return self.slots * sum(self.copies)

    @property
    def total(self) -> int:
        """All the node holds at its peak: this layout's slots and the earlier one's files."""
        return self.own_bytes + self.replica_bytes + self.kept

    @property
    def state_bytes(self) -> int:
        """The node's own training state (one copy of each of its ranks' shards)."""
        return sum(self.own)

    def explain(self) -> str:
        """Where the bytes go, in words."""
        out = (f"{self.slots} slots x {self.own_ranks} rank(s) run here"
               f"{_sizes(self.own)} = {_gib(self.own_bytes)}")
        if self.copies:
            out += (f", plus {self.slots} slots x {self.replica_ranks} peer rank(s) whose "
                    f"copies this node keeps{_sizes(self.copies)} = "
                    f"{_gib(self.replica_bytes)}")
        if self.kept:
            out += (f", plus {_gib(self.kept)} of the layout before (a resize or a move "
                    "keeps its files as the fallback until the new layout commits a step)")
        return out


def _sizes(sizes: Sequence[int]) -> str:
    """" x 100.0 MiB" (a slot's bytes), or, where the ranks' shards differ, their range and
    sum: " (10.0 MiB to 30.0 MiB a slot, 52.0 MiB in all)"."""
    if len(set(sizes)) <= 1:
        return f" x {_gib(sizes[0] if sizes else 0)}"
    return f" ({_gib(min(sizes))} to {_gib(max(sizes))} a slot, {_gib(sum(sizes))} in all)"


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
        + _lower(bool(fp.kept)))


def over_elsewhere(over: Mapping[int, tuple[int, int]]) -> str:
    """The error of a rank whose own node fits while others' do not (``over``: rank -> that
    rank's node total and the limit it checked against): the job stops on every rank."""
    shown = sorted(over.items())[:4]
    nodes = "; ".join(f"the node of rank {r} would hold {_gib(total)} of host RAM, more than "
                      f"the {_gib(limit)} it allows" for r, (total, limit) in shown)
    more = f" (and {len(over) - len(shown)} more)" if len(over) > len(shown) else ""
    return (f"{nodes}{more}: that rank's error says where the bytes go (ram_budget or the "
            "shared-memory file system's room). This node fits, but no rank goes on without "
            "the others. " + _lower(False))


def _lower(kept: bool) -> str:
    return (
        "Lower it with fewer copies (placement.replicas), fewer ranks per node "
        "(workers.workers_per_node), less state per rank (more ranks, ZeRO/FSDP sharding), "
        "or raise Config.ram_budget (a fraction of the node's RAM, or bytes) and the "
        "tmpfs size (mount -o remount,size=... /dev/shm)" + (
            "; the layout before is freed once the new layout commits a step: leave room for "
            "both while a resize is under way (workers.min_workers bounds how far a job shrinks)"
            if kept else ""))


def spare_room(budget: int, held: int) -> int:
    """What a warm spare may prepare on a node whose memckpt files hold ``held`` bytes."""
    return max(0, budget - held)
