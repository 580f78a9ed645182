"""What the driver hands each rank for one generation: its place in the job and, after a
failure, where its shard of the resumed step is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from memckpt.config import Config

if TYPE_CHECKING:
    from memckpt.runtime.chaos.faults import Fault


@dataclass(frozen=True)
class RestoreInstruction:
    step: int
    sources: tuple[str, ...]  # node ids holding the shard, best first; or ("persist",)
    tier: Optional[int] = None  # with ("persist",): the tier index and its manifest (JSON)
    manifest: Optional[str] = None
    placed: bool = False  # the step is already on this rank's node and all its holders
    # a resize: the step was written by ``from_size`` ranks; old rank -> nodes holding its
    # shard. This rank reads the chunks it needs of each through the universal restore.
    reshard: Optional[dict[int, tuple[str, ...]]] = None
    from_size: Optional[int] = None


@dataclass(frozen=True)
class WorkerSpec:
    rank: int
    world_size: int
    gen: int
    config: Config
    holders: tuple[str, ...]  # this rank's replica holder nodes
    stores: dict[str, Any]  # node id -> ReplicaStore actor handle
    coordinator: Any
    restore: Optional[RestoreInstruction]
    faults: tuple[Fault, ...] = ()  # fired from inside the step, exactly at at_step
    resized: bool = False  # this generation runs at another world size than the last
    # every rank placement put on this rank's node this generation (its own included): its
    # node's store reports them together (memckpt.runtime.worker.node_link); () reports alone
    node_ranks: tuple[int, ...] = ()
    # the ranks whose copies this rank's node keeps (what its slots are planned against)
    node_copies: tuple[int, ...] = ()
    # the nodes whose step batches one store merges, this rank's node among them, leader
    # first (memckpt.policy.relay_groups); () sends them to the coordinator itself
    relay: tuple[str, ...] = ()


def copies_by_node(holders: Mapping[int, Sequence[str]]) -> dict[str, tuple[int, ...]]:
    """node -> the ranks whose replicas ``holders`` puts on it (each spec's ``node_copies``)."""
    out: dict[str, list[int]] = {}
    for r in sorted(holders):
        for node in holders[r]:
            out.setdefault(node, []).append(r)
    return {n: tuple(rs) for n, rs in out.items()}


def ranks_by_node(assignment: dict[int, str]) -> dict[str, tuple[int, ...]]:
    """node -> the ranks ``assignment`` puts on it (each spec's ``node_ranks``)."""
    out: dict[str, list[int]] = {}
    for r in sorted(assignment):
        out.setdefault(assignment[r], []).append(r)
    return {n: tuple(rs) for n, rs in out.items()}
