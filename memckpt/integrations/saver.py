"""One rank's snapshot calls, whichever front door made them: a :class:`memckpt.Config`
(one process: a :class:`memckpt.Checkpointer` in ``/dev/shm``), the context ``memckpt.run``
hands the training function, or ``memckpt.ray_train.context()``."""

from __future__ import annotations

from typing import Any, Optional

from memckpt.checkpointer import Checkpointer, RestoreAndStep
from memckpt.config import Config
from memckpt.errors import StateError
from memckpt.format.state import TrainState


class Saver(RestoreAndStep):
    """``restore``/``step`` over a Checkpointer this object owns, or over a context it borrows.

    A Checkpointer made here is closed by :meth:`finished` (its RAM snapshots freed: a second
    run of a finished job starts fresh) or by :meth:`failed` (they are kept: the next run
    resumes from them). A borrowed context belongs to its front door, which closes it.
    """

    def __init__(self, target: Any, rank: int = 0, world_size: int = 1, *, who: str) -> None:
        self.owned = isinstance(target, Config)
        if self.owned and world_size > 1:  # no commit across ranks: each could keep another step
            raise StateError(f"{who}: a memckpt.Config serves one process, this is rank {rank} of "
                             f"{world_size}; run the script under memckpt.run and pass its ctx, or "
                             "pass memckpt.ray_train.context() inside a TorchTrainer")
        if self.owned:
            self.inner: RestoreAndStep = Checkpointer(target, rank=rank, world_size=world_size)
        elif isinstance(target, RestoreAndStep):
            self.inner = target
        else:
            raise StateError(f"{who} needs a memckpt.Config, the ctx memckpt.run passes the training "
                             f"function, or memckpt.ray_train.context(); got {type(target).__name__}")
        self.config: Config = self.inner.config
        self.rank, self.world_size = self.inner.rank, self.inner.world_size
        self.restore_source: Optional[str] = None
        self.closed = False

    def restore(self, state: TrainState) -> int:
        step = self.inner.restore(state)
        self.restore_source = self.inner.restore_source
        return step

    def step(self, state: TrainState, step: int, **metrics: float) -> None:
        """Snapshot when due; ``metrics`` (the front door's loss) reach the coordinator
        under ``memckpt.run`` and Ray Train, the shard's header in one process."""
        self.inner.step(state, step, **metrics)

    def close(self) -> None:
        """Keep the snapshots (as after a failure); a borrowed context is its door's."""
        self._close(unlink=False)

    def finished(self) -> None:
        """Training ended normally: free an owned Checkpointer's RAM snapshots."""
        self._close(unlink=True)

    def failed(self) -> None:
        """Training raised: keep the snapshots for the next run."""
        self._close(unlink=False)

    def _close(self, unlink: bool) -> None:
        if isinstance(self.inner, Checkpointer) and self.owned and not self.closed:
            self.closed = True
            self.inner.close(unlink=unlink)
