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
from typing import Callable, Optional

import numpy as np

from memckpt.format import shard as fmt
from memckpt.checkpointer import Checkpointer
from memckpt.config import Config
from memckpt.format.state import TrainState
from memckpt.policy.footprint import NodeFootprint
from memckpt.persist.uploader import Persister


class RankCheckpointer(Checkpointer):
    # a step commits when the coordinator says every copy of every rank is placed
    commits_when_sealed = False

    def __init__(self, config: Config, rank: int, world_size: int, directory: Path,
                 on_sealed: Callable[[int, Path], None], *, node_ranks: int = 1,
                 node_copies: int = 0) -> None:
        self.node_copies = node_copies
        super().__init__(config, rank, world_size, directory=directory, on_sealed=on_sealed,
                         local_ranks=node_ranks)

    def footprint(self, shard_bytes: int) -> NodeFootprint:
        """Two slots for each rank this node runs and for each rank whose copy its store
        keeps (placement's holders), every shard taken to be this rank's size."""
        return NodeFootprint(shard_bytes, own_ranks=self.local_ranks,
                             replica_ranks=self.node_copies)

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
