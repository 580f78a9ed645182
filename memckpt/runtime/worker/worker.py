"""A training worker: one rank's process, as a long-lived Ray actor (:class:`Worker`).

Each generation it runs the user's function with a :class:`~memckpt.runtime.worker.context.WorkerContext`
(the context, the replicator and the rank's checkpointer live in their own modules); a
survivor is reused for the next generation, and a spare made ahead of time keeps the
memory a restore fills ready (:meth:`Worker.prefault`).
"""

from __future__ import annotations

import gc
import math
import os
import threading
import time
import traceback
from typing import Any, Callable, Optional

import psutil

from memckpt.format import shard as fmt
from memckpt.format.dtensor import forget_meshes
from memckpt.config import Config
from memckpt.engine.buffers import allocated_bytes, resolve_ram_root
from memckpt.engine.populate import MIN_BYTES, POOL, HostReserve, spare_budget
from memckpt.policy.footprint import budget_bytes, spare_room
from memckpt.runtime.wire.ram_files import node_dir
from memckpt.runtime.worker.context import StopTraining, WorkerContext
from memckpt.runtime.worker.node_link import NodeLink
from memckpt.runtime.worker.result import ReplicationTotals, WorkerInfo, WorkerResult
from memckpt.runtime.worker.spec import RestoreInstruction, WorkerSpec
from memckpt.format.state import restore_allocations

PARK_S = 2.0  # how long park() waits for a spare's prefault to end (it does within a chunk)

# WorkerContext, WorkerSpec, RestoreInstruction and StopTraining live in their own modules;
# importable from here as before.
__all__ = ["RestoreInstruction", "StopTraining", "Worker", "WorkerContext", "WorkerSpec",
           "launcher_env", "release_frames", "reset_framework_state", "settle_imports",
           "warm_torch"]


def launcher_env(rank: int, world_size: int, master: tuple[str, int]) -> dict[str, str]:
    """The variables torchrun sets, for this generation's rank: frameworks that read them
    (accelerate under the Hugging Face Trainer, Lightning) then join the process group the
    worker already made instead of launching or initialising their own. Ray gives each
    worker its own devices, so the local rank is 0 in a local world of 1 (as one torchrun
    node per rank), and the node's group rank is the rank."""
    return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank), "MASTER_ADDR": master[0],
            "MASTER_PORT": str(master[1])}


def reset_framework_state() -> None:
    """Forget the rank and process group a framework cached in this process: a survivor
    runs the next generation, maybe as another rank of another world size. accelerate keeps
    both in a process-wide singleton (the Hugging Face Trainer resets it itself; a loop
    that makes its own ``Accelerator`` does not); torch's DTensor caches specs holding the
    old group's meshes (:func:`memckpt.format.dtensor.forget_meshes`)."""
    import sys

    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
    forget_meshes()


def release_frames(exc: Optional[BaseException]) -> None:
    """Drop the local variables of the finished frames an exception's traceback holds (and
    those of the exceptions it chains): a generation ended by recovery unwinds through the
    training function, whose model and optimizer would otherwise stay alive as long as the
    exception does: through the ``gc.collect()`` that runs while it propagates, then for
    as long as Ray holds it. The traceback itself, file and line of every frame, is
    unchanged. Not freed: what a frame's own function closes over (CPython keeps the
    function of a cleared frame), e.g. the module of ``nn.Module._call_impl``'s closure:
    see docs/testing.md on survivors held past the stop grace."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


def warm_torch() -> None:
    """Pay torch's lazy first-use costs now (the optimizers import torch._dynamo, skip_init
    the meta registrations, DDP and ZeRO torch.distributed's modules: ~1 s here), so a
    spare that takes over a rank builds its model at once instead of after them."""
    import torch
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401
    from torch.nn.utils import skip_init

    layer = skip_init(torch.nn.Linear, 2, 2)
    opt = torch.optim.AdamW(layer.parameters())
    for p in layer.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()


def settle_imports() -> None:
    """Hide what is alive now from the cyclic garbage collector for good (``gc.freeze``): the
    ~300k import-time objects of torch, Ray and memckpt, which live as long as the process
    anyway. A full collection then walks only what training creates. The collection that
    frees a failed generation's state before the next restore (:meth:`Worker.run`) sits on
    the recovery's critical path: 0.17 s here with them, under 1 ms without; the
    interpreter's own full collections during training shrink the same way."""
    gc.collect()
    gc.freeze()


class Worker:
    """One rank's process, as a long-lived Ray actor.

    ``run`` executes one generation of the user's function; after a peer failed,
    a surviving worker is reused for the next generation (warm: no new process,
    no re-import of torch), restoring from its own node's RAM. A fresh actor made
    ahead of time with no generation yet is a warm *spare* for a node.
    """

    def __init__(self, config: Config, coordinator: Any) -> None:
        import ray
        warm_torch()  # a spare must be ready to train at once
        settle_imports()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.ip = ray.util.get_node_ip_address()
        self._takeover = threading.Lock()  # prefault against run: who owns the pool
        self._rendezvous: Any = None  # the TCPStore address() hosts for the next generation
        self._running = threading.Event()
        self._prefaulting = 0  # prefault calls under way (a worker parks only without one)
        self.rebind(config, coordinator)
        self._hb = threading.Thread(target=self._heartbeat, daemon=True)
        self._hb.start()

    def rebind(self, config: Config, coordinator: Any) -> str:
        """Serve ``config``'s job and ``coordinator``: at start, and for a worker kept from a
        finished job of this driver (:mod:`memckpt.runtime.driver.kept`; :meth:`park` forgot that
        one). Returns the node it runs on."""
        self.config, self.coordinator = config, coordinator
        self._parked = False
        self.spec: Optional[WorkerSpec] = None
        self.ctx: Optional[WorkerContext] = None
        self.link: Optional[NodeLink] = None  # this generation's line to its node's store
        self.reserve = HostReserve()  # held while a spare idles (see prefault)
        return self.node_id

    def park(self) -> bool:
        """The job finished: give back what it held (the pool's tensors, a spare's
        reserve; a prefault under way ends within a chunk) and forget it, to be kept
        for the driver's next job. False (the driver kills it instead) while a generation
        runs or a prefault does not end in time."""
        if self._running.is_set():
            return False
        with self._takeover:
            self._parked = True  # a prefault asked from now on does nothing
            self.spec, self.ctx, self.link = None, None, None
        deadline = time.monotonic() + PARK_S
        while True:
            self.reserve.release()  # interrupts a hold under way
            POOL.clear()  # and stops a fill
            if not self._prefaulting or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        gc.collect()
        return not self._prefaulting

    def _heartbeat(self) -> None:
        """Beats to the node's store (its heartbeat carries the rank's to the coordinator)."""
        while True:
            time.sleep(self.config.failure.heartbeat_interval_s)  # a kept worker's job's
            link, ctx = self.link, self.ctx
            if self._running.is_set() and link is not None:
                link.beat(ctx.last_step if ctx is not None else -1)

    def address(self) -> tuple[str, int]:
        """As the next generation's rank 0: where its ranks meet to make their process group
        (:mod:`~memckpt.runtime.worker.rendezvous`: this worker listens there from now on)."""
        import datetime

        from memckpt.runtime.worker import rendezvous
        timeout = datetime.timedelta(seconds=self.config.failure.collective_timeout_s)
        self._rendezvous = rendezvous.host(self.ip, timeout)
        return self.ip, self._rendezvous.port

    def abort(self, gen: int) -> None:
        """End generation ``gen``'s training function (recovery: a peer is gone)."""
        ctx, spec = self.ctx, self.spec
        if ctx is not None and spec is not None and spec.gen == gen:
            ctx.abort()

    def prefault(self, shard: Optional[tuple[int, list[list[Any]], int]]) -> int:
        """A spare, once the job's shards exist: prepare the memory a restore of ``shard``
        fills (file bytes, tensor table, data bytes: the job's largest shard, from
        :meth:`memckpt.runtime.node.replica_store.ReplicaStore.largest_shard`; the spare may take
        over any rank,
        a lost node's too). The optimizer state it creates is made ahead in
        :data:`POOL`; for the rest (the parameters), a :class:`HostReserve` is faulted in
        and unmapped at takeover. Either way the restore fills memory the kernel already
        has. It holds no snapshot slots: a rank it takes over adopts its replica's files
        where this node holds them, and otherwise its slots are made at the restore, where
        the lost node's no longer count. Never more than :func:`spare_budget` allows, nor
        than what ``Config.ram_budget`` leaves after the node's memckpt files; skipped
        when the state lives on GPUs (the restore fills device memory) and once this worker
        runs a rank. Returns the bytes the spare holds in all."""
        if self.config.workers.gpus_per_worker or shard is None:
            return 0
        with self._takeover:
            if self._parked:
                return 0
            self._prefaulting += 1
        try:
            return self._prefault(shard)
        finally:
            with self._takeover:
                self._prefaulting -= 1

    def _prefault(self, shard: tuple[int, list[list[Any]], int]) -> int:
        nbytes, table, data_len = shard
        vm = psutil.virtual_memory()
        layout = fmt.Layout.from_json(table, data_len, "the job's largest shard")
        folder = node_dir(resolve_ram_root(self.config.ram_root), self.config.job_name,
                          self.node_id)
        room = spare_room(budget_bytes(self.config.ram_budget, vm.total),
                          allocated_bytes(folder))
        budget = min(spare_budget(nbytes, nbytes, vm.available, vm.total), room)
        specs, room = [], budget
        for shape, dtype in restore_allocations(layout, MIN_BYTES):
            size = math.prod(shape) * dtype.itemsize
            if size <= room:
                specs.append((shape, dtype))
                room -= size
        with self._takeover:  # a rank's restore owns the pool once run() has begun
            if self.spec is not None or self._parked:
                return 0
            POOL.fill(specs)
        POOL.wait()
        self.reserve.hold(max(0, budget - POOL.nbytes))
        return self._held()

    def _held(self) -> int:
        if self.spec is not None:  # took over a rank meanwhile: holds nothing for later
            return 0
        return POOL.nbytes + self.reserve.nbytes

    def info(self) -> WorkerInfo:
        return WorkerInfo(self.spec.rank if self.spec else None, os.getpid(), self.node_id)

    def run(self, train_fn: Callable[[WorkerContext], Any], master: tuple[str, int],
            spec: WorkerSpec) -> WorkerResult:
        import datetime

        import torch
        import torch.distributed as dist

        from memckpt.runtime.worker import rendezvous
        held, self._rendezvous = self._rendezvous, None  # this generation's, if rank 0
        with self._takeover:
            if self.spec is None:  # a spare taking over: its pool stays as far as it got
                POOL.stop()
            self.spec, self.ctx = spec, None
        # what the next generation's restore will create
        ahead: list[tuple[tuple[int, ...], torch.dtype]] = []
        self.reserve.release()  # a spare's reserve: its pages serve the restore below
        # the coordinator keeps it in its state (memckpt kill reads it from the status)
        self.coordinator.register.remote(spec.rank, spec.gen, self.info())
        self.link = NodeLink(spec, self.node_id).start()
        self._running.set()
        torch.set_num_threads(max(1, int(spec.config.workers.cpus_per_worker)))
        os.environ.update(launcher_env(spec.rank, spec.world_size, master))
        reset_framework_state()
        backend = spec.config.workers.backend
        if backend == "auto":
            gpu = torch.cuda.is_available() and spec.config.workers.gpus_per_worker
            backend = "nccl" if gpu else "gloo"
        try:
            if spec.world_size > 1:
                timeout = datetime.timedelta(seconds=spec.config.failure.collective_timeout_s)
                dist.init_process_group(backend, rank=spec.rank, world_size=spec.world_size,
                                        store=rendezvous.join(master, spec.rank, held, timeout),
                                        timeout=timeout)
            self.ctx = WorkerContext(spec, self.node_id, self.link)
            try:
                result = train_fn(self.ctx)
            except StopTraining as stop:
                return WorkerResult(spec.rank, stopped=stop.step,
                                    restore=self.ctx.restore_report)
            except BaseException as e:
                release_frames(e)
                # a failed generation: the next one restores this rank (see POOL)
                ahead = self.ctx.restore_allocations()
                raise
            self.ctx.finish()
            return WorkerResult(spec.rank, result, self.ctx.digest(),
                                restore=self.ctx.restore_report,
                                source=self.ctx.restore_source,
                                replication=ReplicationTotals(self.ctx.replicator.bytes_sent,
                                                              self.ctx.replicator.bytes_filled))
        finally:
            try:
                if self.ctx is not None:
                    self.ctx.close()
            finally:
                # beats on through the close: the driver hears of the result only after it,
                # and a slow close (a loaded node) must not read as a hung rank at the end
                self._running.clear()
            if dist.is_initialized():
                dist.destroy_process_group()
            # Free this generation's training state now: it sits in reference cycles (the
            # context's callbacks, DDP's hooks), and a survivor reused for the next
            # generation would otherwise restore into fresh memory while still holding it.
            # Freed now, its pages are what the pool below gets back (see POOL).
            self.ctx = None
            gc.collect()
            if ahead:  # in the background while the runtime stops and plans
                POOL.fill(ahead)
