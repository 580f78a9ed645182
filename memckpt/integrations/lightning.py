"""PyTorch Lightning: a Callback that snapshots into RAM and makes ``trainer.fit()`` resume by itself.

    sampler = memckpt.ResumableSampler(len(train_set), seed=0)           # instead of shuffle=True
    loader = DataLoader(train_set, batch_size=8, sampler=sampler)
    trainer = L.Trainer(callbacks=[MemckptCallback(memckpt.Config(job_name="fit"), sampler)], ...)
    trainer.fit(model, loader)

Every ``snapshot_every`` optimizer steps (``trainer.global_step``) the whole state goes into
RAM: the LightningModule, every optimizer and LR scheduler, the mixed-precision scaler where
there is one, every global RNG, the fit loop's progress counters (as Lightning's own
checkpoints hold them), the other callbacks' state, and the data position. ``fit()`` then
restores the newest verified snapshot at ``on_fit_start`` (after Lightning set up its
optimizers) and goes on at the next batch of the same epoch (at the next epoch's first after
a snapshot at an epoch's last batch).

The data position is the sampler's: Lightning restarts a plain DataLoader's epoch from its
first batch, so the train DataLoader must draw from a :class:`memckpt.ResumableSampler` (its
order is a function of seed and epoch; its position is taken from the loop's own batch count,
not from the DataLoader's prefetching iterator).

Several ranks (DDP) under ``memckpt.run``: make the Trainer inside the training function, one
device per rank, and pass ``ctx`` as the target::

    def train(ctx):
        trainer = L.Trainer(devices=1, num_nodes=ctx.world_size,
                            strategy="ddp_find_unused_parameters_true",  # one bucket layout
                            use_distributed_sampler=False,  # the ResumableSampler deals the data
                            callbacks=[MemckptCallback(ctx, sampler)], ...)
        trainer.fit(model, loader)

Lightning then joins the process group memckpt made (the worker sets ``LOCAL_RANK``,
``GROUP_RANK``, ``MASTER_ADDR``... as torchrun would) instead of launching processes, and the
callback deals the sampler to the ranks (a sampler made with the default ``world_size=1``
takes the Trainer's rank and world size at ``setup``). ``find_unused_parameters=True`` keeps
DDP's gradient buckets in one layout: without it DDP re-buckets after its first step, and a
resumed generation's first step sums the gradients in another order (its last bits differ).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from lightning.pytorch import Callback
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from memckpt.checkpointer import RestoreAndStep
from memckpt.errors import StateError
from memckpt.format.data import ResumableSampler
from memckpt.format.state import TrainState, rng_state, set_rng_state
from memckpt.integrations.saver import Saver

log = logging.getLogger("memckpt")
WHERE = "memckpt.integrations.lightning.MemckptCallback"


def returned_loss(outputs: Any) -> dict[str, float]:
    """``{"loss": ...}`` from what ``training_step`` returned for the step's last batch (a
    loss tensor, or a dict holding one under "loss"; this rank's), else nothing: what the
    step reports to memckpt.run's coordinator (whose curve is rank 0's)."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return {"loss": float(loss.detach())}
    return {}


class LoopPosition:
    """The fit loop's progress, the other callbacks' state and the sampler's position at the
    batch the loop last finished: the ``data`` entry of the snapshot's TrainState."""

    def __init__(self, callback: "MemckptCallback", trainer: Any) -> None:
        self.callback, self.trainer = callback, trainer
        self.loaded: Optional[dict[str, Any]] = None

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {"fit_loop": t.fit_loop.state_dict(),
                "callbacks": {cb.state_key: cb.state_dict() for cb in t.callbacks
                              if cb is not self.callback and cb.state_dict()},
                "precision": t.precision_plugin.state_dict(),
                "sampler": self.callback.sampler_position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


class MemckptCallback(Callback):
    """RAM snapshots for ``trainer.fit()``, and its resume from them (see the module doc).

    ``target``: a :class:`memckpt.Config` (one process), the ``ctx`` of ``memckpt.run``, or
    ``memckpt.ray_train.context()``. ``sampler``: the train DataLoader's
    :class:`memckpt.ResumableSampler`.
    """

    def __init__(self, target: Any, sampler: ResumableSampler) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise StateError(f"{WHERE} needs the train DataLoader's memckpt.ResumableSampler (Lightning "
                             f"restarts a plain DataLoader's epoch at its first batch); got "
                             f"{type(sampler).__name__}")
        self.target, self.sampler = target, sampler
        self.saver: Optional[Saver] = None
        self.position: Optional[LoopPosition] = None
        self.restored_step = 0
        self.rng: Optional[dict[str, Any]] = None  # re-applied before the first resumed batch
        self.restored_epochs = 0  # epochs the restored loop had processed
        self.last = -1
        self.epoch = 0  # the loop's epoch
        self.batch_end = 0  # batches of this epoch the loop has finished
        # the train loader's, read at each batch; a capture before the first (restore() sizes
        # the snapshot slots from one) has finished no batch, so it needs none
        self.batch_size = 0

    # -- what a snapshot holds -------------------------------------------------------------------
    def state(self, trainer: Any, module: Any) -> TrainState:
        optimizers = {}
        for i, opt in enumerate(trainer.optimizers):
            inner = getattr(opt, "_optimizer", opt)  # LightningOptimizer
            if not isinstance(inner, torch.optim.Optimizer):
                raise StateError(f"memckpt cannot capture the optimizer {type(inner).__module__}."
                                 f"{type(inner).__name__}: it is not a torch.optim.Optimizer; return a "
                                 "torch optimizer from configure_optimizers")
            optimizers[f"optimizer{i}"] = inner
        schedulers = {f"scheduler{i}": c.scheduler for i, c in enumerate(trainer.lr_scheduler_configs)}
        return TrainState(model=getattr(module, "_orig_mod", module), optimizer=optimizers or None,
                          scheduler=schedulers or None,
                          scaler=getattr(trainer.precision_plugin, "scaler", None),
                          data={"lightning": self.position})

    def sampler_position(self) -> dict[str, Any]:
        """The sampler's state as of the last finished batch: the DataLoader's iterator has
        drawn a batch further ahead (Lightning prefetches), which a resume must not skip."""
        s = self.sampler
        state = s.state_dict()
        if s.epoch == self.epoch:  # still in the loop's epoch: rewind to what the loop used
            taken = self.batch_end * self.batch_size
            if taken >= len(s):  # the epoch is done: the next one starts at its beginning
                state.update(epoch=s.epoch + 1, index=0, consumed=0)
            else:
                state.update(index=taken, consumed=s.consumed - (s.index - taken) * s.world_size)
        return state

    def next_epoch(self) -> None:
        """Lightning stops drawing from a sized loader at its length, so the sampler may not
        have seen its epoch end: move it to the next epoch's beginning."""
        s = self.sampler
        if s.epoch == self.epoch:
            state = s.state_dict()
            state.update(epoch=s.epoch + 1, index=0, consumed=0)
            s.load_state_dict(state)

    # -- Lightning hooks ---------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.saver is None:
            self.check_ranks(trainer)
            self.saver = Saver(self.target, trainer.global_rank, trainer.world_size, who=WHERE)
        self.position = LoopPosition(self, trainer)

    def check_ranks(self, trainer: Any) -> None:
        """The Trainer must run the rank of memckpt's context (where it has one), and the
        sampler deal the data to the Trainer's ranks: one it was made with ``world_size=1``
        takes them here, before the loader's first iterator."""
        rank, world = trainer.global_rank, trainer.world_size
        if not isinstance(self.target, RestoreAndStep):
            return  # a Config: one process, whatever the Trainer runs (Saver checks it)
        ctx_rank, ctx_world = self.target.rank, self.target.world_size
        if (rank, world) != (ctx_rank, ctx_world):
            raise StateError(f"{WHERE}: the Trainer runs rank {rank} of {world}, memckpt's context is "
                             f"rank {ctx_rank} of {ctx_world}; make the Trainer with devices=1, "
                             "num_nodes=ctx.world_size (DDP over the process group memckpt.run made)")
        s = self.sampler
        if s.world_size == 1 and world > 1:
            s.rank, s.world_size = rank, world
        elif (s.rank, s.world_size) != (rank, world):
            raise StateError(f"{WHERE}: the ResumableSampler deals rank {s.rank} of {s.world_size}, the "
                             f"Trainer runs rank {rank} of {world}; make it with rank=trainer.global_rank, "
                             "world_size=trainer.world_size, or leave both out (the callback sets them)")

    def check_loader(self, trainer: Any) -> None:
        """The train DataLoader must draw from this callback's sampler: Lightning replaces a
        custom sampler with its DistributedSampler under DDP unless told not to."""
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader):  # several train loaders: not checked
            return
        if any(s is self.sampler for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None))):
            return
        if trainer.world_size > 1 and isinstance(loader.sampler, torch.utils.data.DistributedSampler):
            raise StateError(f"{WHERE}: Lightning replaced the train DataLoader's ResumableSampler with "
                             "its DistributedSampler; make the Trainer with use_distributed_sampler=False "
                             "(the ResumableSampler deals the data to the ranks)")
        raise StateError(f"{WHERE}: the train DataLoader draws from {type(loader.sampler).__name__}, not "
                         "from the ResumableSampler given to MemckptCallback; pass the loader's sampler")

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Lightning built its optimizers: load the newest snapshot, then hand the loop its
        progress counters as its own checkpoint restore would."""
        assert self.saver is not None and self.position is not None
        ddp = getattr(trainer.strategy, "model", None)
        if isinstance(ddp, DistributedDataParallel) and not ddp.find_unused_parameters and \
                trainer.is_global_zero:
            log.warning("memckpt: DDP without find_unused_parameters re-buckets gradients after its "
                        "first step, so a resumed run's first step is not bit-identical; pass "
                        "Trainer(strategy=\"ddp_find_unused_parameters_true\")")
        self.restored_step = self.last = 0
        step = self.saver.restore(self.state(trainer, pl_module))
        if not step:
            return
        loaded = self.position.loaded
        assert loaded is not None  # the restore that returned a step filled it
        self.sampler.load_state_dict(loaded["sampler"])
        trainer.fit_loop.load_state_dict(loaded["fit_loop"])
        self.restored_epochs = trainer.fit_loop.epoch_progress.total.processed
        if loaded["precision"]:
            trainer.precision_plugin.load_state_dict(loaded["precision"])
        for cb in trainer.callbacks:
            if cb.state_key in loaded["callbacks"]:
                cb.load_state_dict(loaded["callbacks"][cb.state_key])
        self.restored_step = self.last = step
        self.rng = rng_state()
        log.warning("memckpt: resumed from the RAM snapshot of step %d (job %r)", step,
                    self.saver.config.job_name)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.check_loader(trainer)  # the loaders are set up, no batch drawn yet
        loop = trainer.fit_loop
        if self.rng is not None and loop.epoch_progress.total.processed > self.restored_epochs:
            self.start_next_epoch(trainer)
        self.epoch = trainer.current_epoch

    def start_next_epoch(self, trainer: Any) -> None:
        """The snapshot was at an epoch's last batch. Lightning's restore closed that epoch but
        runs the next one as a resumed one, so it skips two things an uninterrupted run does
        at an epoch's start, which this does in that run's order instead."""
        assert self.rng is not None and self.position is not None and self.position.loaded
        loop = trainer.fit_loop
        # Count the epoch as started: a later snapshot of it would otherwise hold counters
        # that Lightning reads as an epoch not yet begun, and it would rerun the epoch.
        loop.epoch_progress.increment_ready()
        loop.epoch_progress.increment_started()
        # Make the epoch's train iterator from the snapshot's RNG: a DataLoader without a
        # generator of its own draws its base seed from the global torch RNG, and the one
        # Lightning made at set-up drew before the RNG was put back (dropout would differ).
        set_rng_state(self.rng)
        self.sampler.load_state_dict(self.position.loaded["sampler"])  # a loader without a length prefetched
        iter(loop._data_fetcher)  # as the epoch loop's on_run_start does at each new epoch
        self.rng = rng_state()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.rng is not None:  # sanity checks and the loader's set-up ran since the restore
            set_rng_state(self.rng)
            self.rng = None

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.last:  # a micro-batch of gradient accumulation: no optimizer step yet
            return
        self.last = step
        self.epoch, self.batch_end = trainer.current_epoch, batch_idx + 1
        self.batch_size = trainer.train_dataloader.batch_size
        assert self.saver is not None
        self.saver.step(self.state(trainer, pl_module), step, **returned_loss(outputs))

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.epoch = trainer.current_epoch

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.next_epoch()

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        if self.saver is not None:
            self.saver.finished()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.saver is not None:
            self.saver.failed()
