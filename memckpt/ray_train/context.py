"""The worker side of the Ray Train front door: the context a ``train_loop_per_worker``
gets from :func:`context`, with the same ``restore`` / ``step`` as ``memckpt.run``'s.

:class:`~memckpt.ray_train.MemckptCallback` hands each Ray Train worker its
:class:`~memckpt.runtime.worker.worker.WorkerSpec` (rank, generation, replica holders, stores,
coordinator, where to restore from) before the training function starts; the context
is memckpt's own :class:`~memckpt.runtime.worker.worker.WorkerContext` built from it, plus a
heartbeat (a hung rank is found by the coordinator and killed by the callback) and the
report of persisted steps to Ray Train as its checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Optional

from memckpt.checkpointer import RestoreAndStep
from memckpt.errors import ConfigError, MemckptError
from memckpt.runtime.ray_nodes import WorkerInfo
from memckpt.runtime.worker.replicator import Replicator
from memckpt.runtime.worker.context import RankStats
from memckpt.runtime.worker.worker import RestoreInstruction, WorkerContext, WorkerSpec
from memckpt.format.state import TrainState

REPORT_WAIT_S = 600.0  # a reported step's manifest is this late: the persisted tier is stuck

_spec: Optional[WorkerSpec] = None
_report: Optional[tuple[int, str]] = None  # (tier index, its root) Ray Train's checkpoints live in
_context: Optional["RayTrainContext"] = None


def install(spec: WorkerSpec, report: Optional[tuple[int, str]]) -> int:
    """Called by the callback on each worker actor of a new worker group (before the
    training function runs). Returns the process id."""
    global _spec, _report, _context
    _spec, _report, _context = spec, report, None
    return os.getpid()


def context() -> "RayTrainContext":
    """The memckpt context of this Ray Train worker (one per worker group): call it inside
    ``train_loop_per_worker`` of a trainer whose ``RunConfig(callbacks=[...])`` has a
    :class:`~memckpt.ray_train.MemckptCallback`."""
    global _context
    if _context is None:
        if _spec is None:
            raise ConfigError("memckpt.ray_train.context() found no memckpt job: add "
                              "memckpt.ray_train.MemckptCallback(config) to the trainer's "
                              "RunConfig(callbacks=[...]) and call context() inside "
                              "train_loop_per_worker")
        _context = RayTrainContext(_spec, _report)
    return _context


class RayTrainContext(RestoreAndStep):
    """``restore(state)`` -> the step to continue after; ``step(state, step, **metrics)``
    after each step; ``finish()`` at the end reports the last persisted step to Ray Train."""

    def __init__(self, spec: WorkerSpec, report: Optional[tuple[int, str]]) -> None:
        import ray
        node = ray.get_runtime_context().get_node_id()
        if spec.restore is None and spec.config.persistence:
            spec = dataclasses.replace(spec, restore=_from_storage(report[0] if report else None))
        self._inner = WorkerContext(spec, node)
        self.rank, self.world_size = spec.rank, spec.world_size
        self.restore_source: Optional[str] = None  # set by restore
        self.config, self.generation, self.node_id = spec.config, spec.gen, node
        self._report = report
        self._reported = spec.restore.step if spec.restore is not None else 0
        spec.coordinator.register.remote(spec.rank, spec.gen,
                                         WorkerInfo(spec.rank, os.getpid(), node))
        threading.Thread(target=self._heartbeat, name="memckpt-heartbeat", daemon=True).start()

    @property
    def last_step(self) -> int:
        return self._inner.last_step

    @property
    def replicator(self) -> Replicator:
        return self._inner.replicator


    def stats(self) -> RankStats:
        """See :meth:`memckpt.runtime.worker.context.WorkerContext.stats`."""
        return self._inner.stats()

    def _heartbeat(self) -> None:
        """Beats for as long as the process lives: a rank done with its loop waits for Ray
        Train to end the group and is not hung; a stopped process stops beating."""
        while True:
            time.sleep(self.config.failure.heartbeat_interval_s)
            self._inner.link.beat(self._inner.last_step)

    def restore(self, state: TrainState) -> int:
        """Load the step memckpt chose for this restart (0 on a fresh start): from this
        node's RAM, a peer's store, or, with every RAM copy gone, Ray Train's checkpoint."""
        step = self._inner.restore(state)
        self.restore_source = self._inner.restore_source
        return step

    def step(self, state: TrainState, step: int, **metrics: float) -> None:
        """Snapshot ``step`` into RAM (replicated in the background); at each persisted
        interval, report the previous interval's complete checkpoint to Ray Train."""
        self._inner.step(state, step, **metrics)
        if self._report is not None:
            every = self.config.persistence[self._report[0]].every
            if step % every == 0 and step - every > self._reported:
                self._report_persisted(step - every, metrics)

    def finish(self, timeout_s: float = 600.0) -> None:
        """Commit the last snapshot everywhere, persist it if due and report the newest
        persisted step to Ray Train. Call once after the last ``step``."""
        self._inner.finish(timeout_s)
        if self._report is not None:
            every = self.config.persistence[self._report[0]].every
            last = self._inner.last_step - self._inner.last_step % every
            if last > self._reported:
                self._report_persisted(last, {})
        self._inner.close()

    def close(self) -> None:
        """Stop this rank's replication and its line to the node (:meth:`finish` does too,
        after committing the last snapshot)."""
        self._inner.close()

    def digest(self) -> Optional[str]:
        return self._inner.digest()

    def _report_persisted(self, step: int, metrics: dict[str, float]) -> None:
        """Every rank reports the same step (a Ray Train barrier) once its manifest is
        written; Ray Train registers the memckpt folder as it is (NO_UPLOAD)."""
        import ray
        import ray.train
        from ray.train import Checkpoint, CheckpointUploadMode

        from memckpt.persist import CheckpointStore
        from memckpt.persist.manifest import step_folder
        assert self._report is not None  # only called when a tier reports
        tier, root = self._report
        deadline = time.time() + REPORT_WAIT_S
        coord = self._inner.spec.coordinator
        store = CheckpointStore(self.config.persistence[tier])
        polls = 0
        while ray.get(coord.persisted.remote()).get(str(tier), -1) < step:
            # a step redone after a resume that an earlier run had persisted is not
            # written again (the persister skips a committed step): its manifest is there
            polls += 1
            if polls % 50 == 0 and store.is_committed(step):
                break
            if self._inner.replicator.error is not None:
                raise self._inner.replicator.error
            if time.time() > deadline:
                raise MemckptError(f"step {step} was not persisted to {root} within "
                                   f"{REPORT_WAIT_S:.0f} s: check the tier's events")
            time.sleep(0.01)
        storage = ray.train.get_context().get_storage()
        folder = step_folder(step)
        path = f"{storage.experiment_fs_path.rstrip('/')}/{_tail(root)}/{folder}"
        ray.train.report(dict(metrics, step=step),
                         checkpoint=Checkpoint(path, filesystem=storage.storage_filesystem),
                         checkpoint_dir_name=folder,
                         checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
        self._reported = step


def _tail(root: str) -> str:
    return root.rstrip("/").rsplit("/", 1)[-1]


def _from_storage(tier: Optional[int]) -> Optional[RestoreInstruction]:
    """No RAM copy to restore from: Ray Train's latest checkpoint (after the whole cluster
    was lost, or every copy of some rank), which is a memckpt checkpoint folder; without
    one (a report Ray Train had not registered yet when the run died), memckpt's newest
    valid persisted checkpoint in any tier."""
    import ray.train

    from memckpt.persist import CheckpointStore
    from memckpt.persist.uploader import persisted_restore
    spec = _spec
    assert spec is not None
    checkpoint = ray.train.get_checkpoint() if tier is not None else None
    if checkpoint is not None and tier is not None:
        folder = checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
        manifest = CheckpointStore(spec.config.persistence[tier]).manifest_of(folder)
    else:
        stores = [CheckpointStore(t) for t in spec.config.persistence]
        found, newest, _ = persisted_restore(stores, spec.world_size)
        if newest is None:
            return None
        tier, manifest = found, newest
    return RestoreInstruction(manifest.step, ("persist",), tier, manifest.to_json())
