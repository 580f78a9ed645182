"""One rank's snapshots as the runtime drives them, named by what the worker needs.

A :class:`memckpt.Checkpointer` whose steps count as committed only when the coordinator
says every copy is placed, whose sealed steps go to the replicator, which persists nothing
itself (the worker's context persists committed steps) and reads no stop file (the driver
does, and asks every rank), and which a restore fills by adopting a replica's files
or fetching a peer's copy into a slot. The worker, its
context and its replicator reach the snapshot engine only through these methods.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import numpy as np

from memckpt.format import shard as fmt
from memckpt.checkpointer import Checkpointer, planned_slot_bytes
from memckpt.config import Config
from memckpt.engine.buffers import allocated_bytes
from memckpt.format.state import Captured, TrainState
from memckpt.errors import MemoryBudgetError
from memckpt.policy.footprint import NodeFootprint, over_budget, over_elsewhere
from memckpt.persist.uploader import Persister
from memckpt.runtime.wire.ram_files import OWN, REPLICAS

if TYPE_CHECKING:
    import torch


class RankCheckpointer(Checkpointer):
    # a step commits when the coordinator says every copy of every rank is placed
    commits_when_sealed = False

    def __init__(self, config: Config, rank: int, world_size: int, directory: Path,
                 on_sealed: Callable[[int, Path], None], *, node_ranks: Sequence[int] = (),
                 node_copies: Sequence[int] = ()) -> None:
        self.node_ranks = tuple(node_ranks) or (rank,)  # the ranks this node runs
        self.node_copies = tuple(node_copies)  # the ranks whose copies its store keeps
        # rank -> its planned slot bytes, from the last exchange (see plan); empty: none
        # took place (no process group), every rank is then taken to be this one's size
        self.slot_sizes: dict[int, int] = {}
        self._gathered: Optional[list[int]] = None  # the last exchange's result
        self._settled = True  # sizes stopped changing: no exchange at later snapshots
        self._start: Optional[int] = None  # the generation's restored step (plan's)
        super().__init__(config, rank, world_size, directory=directory, on_sealed=on_sealed,
                         local_ranks=len(self.node_ranks))

    # -- the node's planned footprint -----------------------------------------------------------
    def footprint(self, shard_bytes: int) -> NodeFootprint:
        """Two slots for each rank this node runs and for each rank whose copy its store
        keeps (placement's holders), each of that rank's planned size (exchanged by
        :meth:`plan`; this rank's is ``shard_bytes``), plus the files of the layout before
        that this layout does not reuse: they stay until it commits a step."""
        sizes = {r: self.slot_sizes.get(r, shard_bytes) for r in self._planned_for()}
        sizes[self.rank] = shard_bytes
        return NodeFootprint.of(sizes, self.node_ranks, self.node_copies,
                                kept=self.kept_bytes())

    def _planned_for(self) -> set[int]:
        return set(self.node_ranks) | set(self.node_copies)

    def kept_bytes(self) -> int:
        """What this node's files outside this layout hold (the own slots of ranks it no
        longer runs, the copies of ranks it no longer keeps): a resize's or a move's
        fallback, freed by the driver once the new layout commits a step."""
        root, kept = self.node_folder(), 0
        for sub, ranks in ((OWN, set(self.node_ranks)), (REPLICAS, set(self.node_copies))):
            for rank_dir in (root / sub).glob("rank*"):
                if not (rank_dir.name[4:].isdigit() and int(rank_dir.name[4:]) in ranks):
                    kept += allocated_bytes(rank_dir)
        return kept

    def plan(self, state: TrainState, step: int) -> None:
        """The generation's restore landed ``step`` in ``state``: tell every rank this one's
        planned slot size, and learn theirs, before any slot of the generation is made.
        Every rank calls it once, in the same place (a collective); later snapshots
        exchange again only while the sizes still change (Adam's moments appear at the
        first optimizer step). Each exchange is two tiny all_gathers (the sizes, then each
        node's verdict): two or three exchanges a generation, none in a steady step."""
        self._start = step
        self._exchange(planned_slot_bytes(state.capture(step)))

    def _planning(self, captured: Captured, step: int) -> None:
        # every rank snapshots the same due steps after the restore's: a collective is safe
        if self._start is not None and step > self._start and not self._settled:
            self._exchange(planned_slot_bytes(captured))

    def _exchange(self, planned: int) -> None:
        """all_gather one int64 (each rank's planned slot bytes) over the job's process group;
        without one (one rank, or a front door that made none), the estimate stays."""
        import torch
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()) or self.world_size < 2 or \
                dist.get_world_size() != self.world_size or dist.get_rank() != self.rank:
            self._settled = True
            return
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(out, torch.tensor([planned], dtype=torch.int64, device=device))
        gathered = [int(n) for n in torch.cat(out).tolist()]  # one device-to-host copy
        # the same list on every rank, so every rank takes the same decision
        self._settled = gathered == self._gathered
        self._gathered = gathered
        self.slot_sizes = {r: gathered[r] for r in self._planned_for() if r < len(gathered)}
        self._decide_together(planned, device)

    def _decide_together(self, planned: int, device: torch.device) -> None:
        """Check this node at the exchanged sizes and tell every rank the verdict (its node's
        total and limit when over, else zeros): one node over its budget stops every rank
        with MemoryBudgetError, before any slot is made. Alone, the rank over it would
        raise while the others go on into a collective and report a lost peer instead
        (and a node whose own slots keep their size would never check the copies a
        resize adds to it)."""
        import torch
        import torch.distributed as dist
        fp, budget, room = self._room(planned)
        problem = over_budget(fp, budget, room)
        mine = torch.tensor([fp.total, min(budget, room)] if problem else [0, 0],
                            dtype=torch.int64, device=device)
        out = [torch.zeros(2, dtype=torch.int64, device=device) for _ in range(self.world_size)]
        dist.all_gather(out, mine)
        rows = torch.stack(out).tolist()
        if problem:
            raise MemoryBudgetError(self._budget_error(problem))
        over = {r: (int(t), int(limit)) for r, (t, limit) in enumerate(rows) if t}
        if over:
            raise MemoryBudgetError(self._budget_error(over_elsewhere(over)))

    def node_folder(self) -> Path:
        return self.directory.parent.parent  # <job>/<node>: own/ and replicas/

    def _make_persister(self) -> Optional[Persister]:
        return None  # committed steps are persisted by the worker's context

    def _prefill(self) -> bool:
        return False  # the worker fills the restore's memory itself, knowing where it restores from

    def step(self, state: TrainState, step: int, **metrics: float) -> bool:
        """Snapshot ``step`` when due, with the step's ``metrics`` in its header; a stop or
        persist request reaches the rank as a commit."""
        return self.due(step) and self.snapshot(state, step, metrics)

    # -- the committed steps --------------------------------------------------------------------
    def read(self, step: int) -> AbstractContextManager[fmt.Shard]:
        """A sealed step's shard, unverified (it is checked where it lands)."""
        return self.engine.reading(step, verify=False)

    def holds(self, step: int) -> bool:
        return step in self.engine.steps()

    @property
    def committed(self) -> Optional[int]:
        return self.engine.committed

    def commit(self, step: int) -> None:
        """Every copy of ``step`` is placed: its slot may now be reused for later steps."""
        self.engine.set_committed(step)

    def resume_at(self, step: int) -> None:
        """A restore resumed at ``step``: newer steps are void, ``step`` is committed."""
        self.engine.discard_newer(step)
        self.engine.set_committed(step)

    def discard(self, step: int) -> None:
        """Drop ``step``'s copy (it failed its check: never restored or sent on again)."""
        self.engine.discard_step(step)

    def abort(self, error: BaseException) -> None:
        """Wake a snapshot waiting for a commit that cannot come, with ``error``."""
        self.engine.abort(error)

    # -- restoring into slots ---------------------------------------------------------------------
    def adopt(self, files: list[Path]) -> None:
        """Make replica files on this node this rank's own slots (renamed, not copied)."""
        self.engine.adopt(files)

    def install(self, step: int, receive: Callable[[Callable[[int], np.ndarray]], np.ndarray],
                source: str) -> fmt.Shard:
        """Fetch ``step`` into a slot of its own (``receive(into)``), verified."""
        return self.engine.install(step, receive, source)

    def newest_layout(self) -> Optional[fmt.Layout]:
        """The layout of the newest complete snapshot (what a restore of it creates)."""
        slots = [s for s in self.engine.slots if s.complete and s.layout is not None]
        return max(slots, key=lambda s: s.age).layout if slots else None
