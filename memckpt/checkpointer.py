"""The single-process API: snapshot every N steps into RAM, restore after a crash.

    ckpt = memckpt.Checkpointer(config)
    start = ckpt.restore(state)            # 0 on a fresh start, else the restored step
    for step in range(start + 1, total + 1):
        train_one_step()
        ckpt.step(state, step)             # snapshot when step % snapshot_every == 0
    ckpt.close()

Snapshots live in shared memory (``ram_root``, ``/dev/shm/memckpt`` by default),
so a new process started after the old one was killed restores from RAM.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import (TYPE_CHECKING, Any, Callable, Mapping, Optional, Protocol, Sequence,
                    runtime_checkable)

import torch

from memckpt.format import shard as fmt
from memckpt.engine.buffers import (allocated_bytes, free_bytes, remove_path,
                                    resolve_ram_root)
from memckpt.config import Config
from memckpt.errors import ChecksumError, MemckptError, MemoryBudgetError, StateError
from memckpt.engine.stop import STOP, Control
from memckpt.util.fsutil import write_atomic
from memckpt.persist.catalog import protect
from memckpt.persist.manifest import ShardEntry
from memckpt.persist.uploader import Persister, persisted_restore
from memckpt.engine.populate import MIN_BYTES, POOL
from memckpt.engine.restore import VerifiedViews, load_memory
from memckpt.engine.shared_pages import open_slot
from memckpt.engine.slot import newest_layout_in
from memckpt.engine.snapshot import SnapshotEngine
from memckpt.engine.stats import EngineStats
from memckpt.policy.footprint import NodeFootprint, budget_bytes, over_budget
from memckpt.policy.threads import hash_threads, local_ranks_from, usable_cores
from memckpt.format.state import Captured, TrainState, restore_allocations, same_layout

if TYPE_CHECKING:
    from memckpt.format.dcp_reader import MemckptReader

log = logging.getLogger("memckpt")


def planned_slot_bytes(captured: Captured) -> int:
    """The slot file a snapshot of ``captured`` maps: header and data, as the engine sizes
    it (what the RAM budget's check is given)."""
    layout = fmt.Layout.of(captured.tensors)
    meta_len = len(json.dumps(captured.meta, separators=(",", ":")))
    return fmt.region_size(layout, fmt.header_capacity_for(layout, meta_hint=meta_len))


@runtime_checkable
class RestoreAndStep(Protocol):
    """One rank's restore and step, whichever front door serves it: :class:`Checkpointer`
    (one process), the runtime's rank (``RankCheckpointer``), the context ``memckpt.run``
    hands the training function (``WorkerContext``), ``memckpt.ray_train.context()``
    (``RayTrainContext``) and the integrations' ``Saver`` over any of them.

    ``restore(state)`` loads the step to continue after into ``state`` and returns it (0 on
    a fresh start), and ``restore_source`` then says where it came from (None before, and
    on a fresh start); ``step(state, step, **metrics)`` is called after each finished step,
    snapshots when ``config.snapshot_every`` says so and reports ``metrics`` (the loss) where
    there is someone to report to (the coordinator under ``memckpt.run``; one process keeps
    them in the shard's header); ``close()`` releases what it holds (snapshots stay in RAM
    for the next run). ``rank`` and ``world_size`` are the process's place in the job. Each
    class adds only what is its own.
    """

    config: Config
    rank: int
    world_size: int
    restore_source: Optional[str]

    def restore(self, state: TrainState) -> int: ...

    def step(self, state: TrainState, step: int, **metrics: float) -> object: ...

    def close(self) -> object: ...


class Checkpointer(RestoreAndStep):
    """In-RAM snapshots for one rank, double-buffered in shared memory.

    Guarantees: ``step()`` returns once the local copy is taken (in overlap mode,
    once the small tensors are; parameters may be updated only after
    ``optimizer.step``'s hook or :meth:`wait_copy`). ``restore()`` loads only a
    snapshot whose checksums verify, newest first, and says which it skipped.
    """

    # A sealed snapshot counts as committed: one process has no copies elsewhere to wait for.
    commits_when_sealed = True

    def __init__(self, config: Config, rank: int = 0, world_size: int = 1,
                 directory: Optional[str | Path] = None, *,
                 on_sealed: Optional[Callable[[int, Path], None]] = None,
                 local_ranks: Optional[int] = None) -> None:
        if not isinstance(config, Config):
            raise StateError(f"Checkpointer needs a memckpt.Config, got {type(config).__name__}")
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.restore_source: Optional[str] = None  # where the last restore came from
        root = Path(directory) if directory else resolve_ram_root(config.ram_root) / config.job_name
        self.directory = root / f"rank{rank}"
        self.events: list[dict[str, Any]] = []
        # ranks on this node share its cores: LOCAL_WORLD_SIZE (torchrun) unless given
        local = local_ranks if local_ranks is not None else local_ranks_from(os.environ)
        self.local_ranks = local
        # before the engine maps the slots, so the two run side by side
        self._prefilled = self._prefill()
        self.engine = SnapshotEngine(
            self.directory, mode=config.snapshot_mode, on_fall_behind=config.failure.on_fall_behind,
            identity={"job": config.job_name, "rank": rank, "world_size": world_size,
                      "fingerprint": config.fingerprint()},
            gated=not self.commits_when_sealed, on_complete=self._sealed, on_sealing=config.engine.on_sealing,
            seal_threads=hash_threads(config.engine.seal_threads, usable_cores(), local),
            room_check=self._check_room, skip_unchanged=config.engine.skip_unchanged,
            share_unchanged=config.engine.share_unchanged)
        self._on_sealed = on_sealed
        self._hooks: dict[int, Any] = {}  # id(optimizer) -> its pre-hook handle
        self.control = Control(config.stop_file)
        self.should_stop = False  # set when a stop file or signal asked the loop to end
        # the metrics the last restored shard's step was snapshotted with (see snapshot)
        self.restored_report: Optional[dict[str, float]] = None
        self.persister = self._make_persister()

    # -- host RAM ---------------------------------------------------------------------------------
    def footprint(self, shard_bytes: int) -> NodeFootprint:
        """What memckpt holds on this node with slots of ``shard_bytes``: two for each of its
        ``local_ranks`` (one process has no replicas elsewhere). Every rank's shard is taken
        to be this one's size: each rank checks, so the largest rank's check, an upper
        bound, decides. (No sizes are exchanged here: under torchrun the process group is
        the user's, and a stop file makes snapshots no collective may wait on; the
        runtime's ranks exchange theirs, see ``RankCheckpointer.plan``.)"""
        return NodeFootprint.even(shard_bytes, own_ranks=self.local_ranks, replica_ranks=0)

    def _planning(self, captured: Captured, step: int) -> None:
        """Before ``step``'s snapshot maps anything: where ranks plan their slots together
        (the runtime's), learn the others' sizes. One process has no one to ask."""

    def node_folder(self) -> Path:
        """The folder holding every memckpt file of this job on this node."""
        return self.directory.parent

    def _check_room(self, slot_bytes: int) -> None:
        """Before a slot file is made or resized: stop with the numbers (never SIGBUS or the
        OOM killer later) when the node's planned footprint exceeds ``Config.ram_budget`` or
        the shared-memory file system's room."""
        problem = over_budget(*self._room(slot_bytes))
        if problem:
            raise MemoryBudgetError(self._budget_error(problem))

    def _room(self, slot_bytes: int) -> tuple[NodeFootprint, int, int]:
        """The node's footprint with this rank's slots of ``slot_bytes``, the budget, and
        the shared-memory file system's room (free, plus what this job's files hold there:
        what the footprint counts of them may be reused)."""
        import psutil
        budget = budget_bytes(self.config.ram_budget, psutil.virtual_memory().total)
        room = free_bytes(self.directory) + allocated_bytes(self.node_folder())
        return self.footprint(slot_bytes), budget, room

    def _budget_error(self, problem: str) -> str:
        return (f"{problem} (job {self.config.job_name!r}, rank {self.rank}, "
                f"files under {self.node_folder()})")

    def _make_persister(self) -> Optional[Persister]:
        """This process persists its own sealed snapshots to the configured tiers."""
        if not self.config.persistence:
            return None
        return Persister(
            self.config.persistence, self.rank, lambda s: self.engine.reading(s, verify=False),
            self.directory / "staging.bin", folder_for=self._folder_for,
            on_written=self._commit, on_event=self._event, world_size=self.world_size)

    def _prefill(self) -> bool:
        """A process that finds a snapshot in RAM (a restart after a crash) is about to
        restore it: fault in the optimizer state the restore creates (two thirds of an Adam
        job's bytes) on every core in the background while the caller builds its trainer,
        so the restore copies into memory that is ready (see :data:`POOL`). Not when CUDA
        is present: GPU state is restored onto the device."""
        layout = newest_layout_in(self.directory)
        if layout is None or torch.cuda.is_available() or POOL.in_use:  # not another's fill
            return False
        POOL.fill(restore_allocations(layout, MIN_BYTES), threads=usable_cores())
        return True

    def _drop_prefill(self) -> None:
        if self._prefilled:
            self._prefilled = False
            POOL.clear()

    def _sealed(self, step: int, path: Path) -> None:
        if self.persister is not None:  # sealed == committed here
            # never waits for storage: an upload in flight makes this a pending request
            self.persister.submit(step, self.persister.due(step), stage_now=True)
        if self._on_sealed is not None:
            self._on_sealed(step, path)

    def _folder_for(self, tier: int, step: int) -> str:
        assert self.persister is not None  # only the persister calls it
        return self.persister.stores[tier].folder_for(step)

    def _commit(self, tier: int, step: int, entry: ShardEntry) -> None:
        assert self.persister is not None  # only the persister calls it
        store = self.persister.stores[tier]
        store.commit(step, self.world_size, [entry], self.config.fingerprint(),
                     job=self.config.job_name)
        self._event("persisted", step=step, tier=store.describe())

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT make the next ``step()`` persist and set ``should_stop``."""
        self.control.install_signal_handlers()

    # -- taking snapshots -------------------------------------------------------------------
    def step(self, state: TrainState, step: int, **metrics: float) -> bool:
        """Call after finishing ``step``; snapshots when due, ``metrics`` (its loss) kept in
        the shard's header (a restore of it gives them back: :attr:`restored_report`).
        Returns True if it snapshotted.

        A stop file or signal (see :mod:`memckpt.engine.stop`) makes this step snapshot
        and persist to every tier before returning, and sets ``should_stop`` to ask
        the training loop to end.
        """
        action = self.control.at(step)
        if not self.due(step) and action is None:
            return False
        took = self.snapshot(state, step, metrics)
        if action is not None:
            self.persist_now(step)
            self.should_stop = action == STOP
        return took

    def due(self, step: int) -> bool:
        """``step`` is one ``config.snapshot_every`` asks a snapshot of."""
        return step % self.config.snapshot_every == 0

    def snapshot(self, state: TrainState, step: int,
                 report: Optional[Mapping[str, float]] = None) -> bool:
        """Snapshot ``step`` now, due or not. Returns False when skipped by policy.
        ``report``: the step's metrics (its loss), kept in the shard's header: a restore
        of this step gives them back as :attr:`restored_report`."""
        if self.config.snapshot_mode == "overlap":
            self._hook_optimizers(state)
        captured = state.capture(step)
        if report:
            captured.meta["report"] = {k: float(v) for k, v in report.items()}
        self._planning(captured, step)
        return self.engine.snapshot(captured, step)

    def persist_now(self, step: Optional[int] = None, timeout_s: Optional[float] = None) -> bool:
        """Persist the newest (or ``step``'s) snapshot to every tier and wait for it: up to
        ``timeout_s``, or by default while the storage makes progress (a tier silent for
        its ``close_timeout_s`` is given up on). True if it landed."""
        self.engine.wait()
        if self.persister is None:
            self._event("persist_skipped", step=step, reason="no persistence tier configured")
            return False
        step = step if step is not None else max(self.engine.steps(), default=None)
        if step is None:
            return False
        tiers = range(len(self.persister.tiers))
        self.persister.submit(step, tiers, stage_now=True, wait=True)
        idle = self.persister.drain() if timeout_s is None else self.persister.flush(timeout_s)
        return idle and all(self.persister.last_persisted.get(t, -1) >= step for t in tiers)

    def _hook_optimizers(self, state: TrainState) -> None:
        # The next parameter update must not start before the background copy has read
        # the parameters and optimizer state it is about to change.
        for opt in state.optimizers.values():
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(
                    lambda *_: self.engine.wait_copy())

    def wait_copy(self) -> None:
        """Overlap mode: block until parameters may be mutated (before manual edits)."""
        self.engine.wait_copy()

    def wait(self) -> None:
        """Block until the last snapshot is sealed (checksummed, complete)."""
        self.engine.wait()

    @property
    def stats(self) -> EngineStats:
        """The engine's counts: ``landed`` snapshots (sealed, restorable), ``skipped`` ones
        (due while the previous was still busy: ``engine.on_sealing="skip"``), ``requested``."""
        return self.engine.stats

    # -- restoring --------------------------------------------------------------------------
    def restore(self, state: TrainState, source: Optional[str | Path] = None) -> int:
        """Load the newest verified snapshot into ``state``; returns its step (0 if none).

        ``source`` names a shard file (from :meth:`save`) to load instead of RAM.
        A corrupt RAM snapshot is skipped for the older one; if every snapshot is
        corrupt, :class:`ChecksumError` lists them rather than starting over silently.
        """
        try:
            return self._restore(state, source)
        finally:
            self._drop_prefill()  # what the restore did not take

    def _restore(self, state: TrainState, source: Optional[str | Path]) -> int:
        if source is not None:
            try:
                region = open_slot(Path(source))
            except MemckptError as e:  # an empty file: as truncated as it gets
                raise ChecksumError(f"{source}: cannot read it as a shard: {e.message}") from None
            shard = fmt.open_shard(region.array, str(source), verify=False)
            fmt.verify_data(shard, str(source), map_fn=self.engine.map_fn)
            return self.load_shard(state, shard, str(source))
        self.engine.wait()
        step = self._restore_ram(state)
        if self.config.engine.prepare_slots:  # the slots still free, mapped behind the loop
            self.engine.prepare(state.capture(step))
        return step

    def _restore_ram(self, state: TrainState) -> int:
        problems = []
        for step in self.engine.steps():
            try:
                with self.engine.reading(step, verify=False) as shard:
                    source = f"ram:{self.engine.path_of(step)}"
                    views = VerifiedViews(shard, source, self.engine.hashers)
                    try:
                        return self.load_shard(state, shard, source, views)
                    finally:
                        views.cancel()
            except ChecksumError as e:
                problems.append(str(e))
                self._event("snapshot_skipped", step=step, reason=str(e))
                log.warning("memckpt: skipping corrupt snapshot of step %d: %s", step, e)
        persisted = self._restore_persisted(state)
        if persisted is not None:
            return persisted
        if problems:
            raise ChecksumError("every snapshot in RAM is corrupt: " + "; ".join(problems) +
                                f". Remove {self.directory} to start from scratch")
        return 0

    def _restore_persisted(self, state: TrainState) -> Optional[int]:
        """Auto-resume: the newest checkpoint across the persistence tiers (resharded when
        another world size or layout wrote it)."""
        if self.persister is None:
            return None
        step, folders = self.resume_persisted(state, self.persister.stores)
        protect(self.persister.stores, folders)
        return step

    def resume_persisted(self, state: TrainState, stores: Sequence[Any],
                         first: Optional[tuple[int, Any]] = None
                         ) -> tuple[Optional[int], dict[int, set[str]]]:
        """Load the newest persisted checkpoint in ``stores`` (the tiers' CheckpointStores)
        into ``state``, or ``first`` = (tier, manifest) when the caller chose it already.

        With ``load.on_incompatible="start_fresh"``, a checkpoint of another model is passed
        over for the newest older one this model can load: after a fresh start beside old
        checkpoints, a restart resumes the new model's own newest step, not step 0 again.
        Returns (the step, or None when nothing loadable was found; the folders per tier
        index to leave untouched: every step folder there was when a checkpoint of another
        model turned up, since the old model's and this one's cannot be told apart by name).
        """
        folders: dict[int, set[str]] = {}
        below: Optional[int] = None
        while True:
            if first is None:
                tier, manifest, reasons = persisted_restore(stores, self.world_size, below)
                for reason in reasons:
                    self._event("checkpoint_skipped", reason=reason)
                    log.warning("memckpt: %s", reason)
                if tier is None or manifest is None:  # None together: nothing to resume
                    return None, folders
            else:
                (tier, manifest), first = first, None
            step = self.load_persisted(state, stores[tier], manifest)
            if step is not None:
                return step, folders
            if not folders:
                folders = {i: {info.folder for info in s.list_checkpoints()}
                           for i, s in enumerate(stores)}
            below = manifest.step

    def load_persisted(self, state: TrainState, store: Any, manifest: Any) -> Optional[int]:
        """Load a persisted checkpoint (``store``: its CheckpointStore) into ``state``; returns
        its step, or None when it holds another model and ``load.on_incompatible`` is
        ``"start_fresh"`` (else :class:`IncompatibleCheckpointError` names the tensor).

        The same world size and layout read this rank's shard whole; otherwise the
        checkpoint is resharded: only the byte ranges overlapping this rank's tensors are
        read (see :mod:`memckpt.format.reshard`) and a ``resharded`` event says from what to what.
        """
        from memckpt.format.dcp_reader import MemckptReader
        from memckpt.persist.dcp_source import PersistedSource
        from memckpt.format.reshard import check_compatible, mismatch
        source = f"{store.describe()}@{manifest.step}"
        reader = MemckptReader(PersistedSource(store, manifest))
        problem = mismatch(reader, state)
        if problem and self.config.load.on_incompatible == "start_fresh":
            self._event("incompatible_checkpoint", step=manifest.step, tier=store.describe(),
                        reason=problem, action="start_fresh")
            log.warning("memckpt: checkpoint step %d in %s holds another model (%s); "
                        "load.on_incompatible='start_fresh': it is left untouched and passed "
                        "over for an older checkpoint of this model, else step 0",
                        manifest.step, store.describe(), problem)
            return None
        # raises IncompatibleCheckpointError naming the tensor and the fix
        check_compatible(reader, state, f"checkpoint step {manifest.step} in {store.describe()}")
        if manifest.world_size == self.world_size and \
                same_layout(state, reader.source.header(self.rank)):
            region = store.read_shard(manifest, self.rank)  # verified
            return self.load_shard(state, fmt.open_shard(region, source), source)
        t0 = time.perf_counter()
        step = self.load_resharded(state, reader)
        self._event("resharded", step=step, source=source, from_world_size=manifest.world_size,
                    to_world_size=self.world_size, bytes_read=reader.source.bytes_read,
                    seconds=time.perf_counter() - t0)
        log.info("memckpt: rank %d resharded step %d of %s from %d ranks to %d (%d bytes read)",
                 self.rank, step, store.describe(), manifest.world_size, self.world_size,
                 reader.source.bytes_read)
        return step

    def load_resharded(self, state: TrainState, reader: "MemckptReader") -> int:
        """Load a checkpoint of another world size or layout into ``state`` as this rank
        (:func:`memckpt.format.reshard.load_resharded`); returns its step. Its metrics come
        back as :attr:`restored_report` from old rank 0's header, as :meth:`load_shard`
        gives a same-layout shard's own."""
        from memckpt.format.reshard import load_resharded, reported
        self.restored_report = None
        step = load_resharded(state, reader, self.rank, self.config.load.kinds())
        self.restored_report = reported(reader)
        return step

    def load_shard(self, state: TrainState, shard: fmt.Shard, source: str,
                   views: Optional[VerifiedViews] = None) -> int:
        """Load a verified shard (from RAM, a file or a peer) into ``state``; returns its step.

        ``views``: the shard's tensors verified as they are loaded (a shard opened
        unverified); each tensor is loaded only once its chunks verified, and the load
        counts only once every chunk did (else :class:`ChecksumError`)."""
        h = shard.header
        if h.get("world_size") != self.world_size or h.get("rank") != self.rank:
            raise StateError(f"{source} is rank {h.get('rank')} of {h.get('world_size')}, this "
                             f"process is rank {self.rank} of {self.world_size}: restore it with "
                             "the same world size")
        if h.get("fingerprint") != self.config.fingerprint():
            log.warning("memckpt: %s was written under a different config (fingerprint %s, now %s)",
                        source, h.get("fingerprint"), self.config.fingerprint())
        t0 = time.perf_counter()
        self.restored_report = None
        step = state.load(shard.tensors if views is None else views, shard.meta,
                          self.config.load.kinds(), load_memory(state))
        if views is not None:
            views.finish()
        self.restored_report = fmt.report_of(shard.meta)
        self.restore_source = source
        self._event("restored", step=step, source=source, seconds=time.perf_counter() - t0)
        return step

    def save(self, path: str | Path, step: Optional[int] = None) -> int:
        """Write the newest (or ``step``'s) complete snapshot to a shard file, atomically."""
        self.engine.wait()
        with self.engine.reading(step) as shard:
            write_atomic(Path(path), shard.raw)
            return shard.step

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append(dict(event=kind, time=time.time(), rank=self.rank, **fields))

    def close(self, unlink: bool = False) -> list[str]:
        """Stop background work; ``unlink`` also frees the RAM snapshots (job finished).

        Persists in flight get to finish while the storage makes progress; a tier that
        is dead or hung is given up on after its ``close_timeout_s``. Returns one line per
        tier whose newest checkpoint was not persisted (also logged); then the RAM
        snapshots are kept even with ``unlink``, so a later process restores from them.
        """
        self._drop_prefill()  # a prefill nobody restored from
        for handle in self._hooks.values():  # the optimizers no longer wait on this engine
            handle.remove()
        self._hooks.clear()
        unpersisted: list[str] = []
        if self.persister is not None:  # it reads the slots: let it finish first
            self.engine.wait()
            unpersisted = self.persister.close()
        if unlink and unpersisted:
            log.warning("memckpt: close(unlink=True) keeps the RAM snapshots in %s because "
                        "%s; a new process of this job restores from them; remove the folder "
                        "once they are not needed", self.directory, "; ".join(unpersisted))
            self._event("ram_kept", directory=str(self.directory), reason=unpersisted)
            unlink = False
        self.engine.close(unlink=unlink)
        if unlink:
            remove_path(self.directory)
        return unpersisted

