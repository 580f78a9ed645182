"""Hugging Face ``transformers.Trainer``: RAM snapshots, and a ``train()`` that resumes by itself.

    trainer = Trainer(model=model, args=args, train_dataset=ds, ...)
    memckpt.integrations.hf.attach(trainer, memckpt.Config(job_name="ft", snapshot_every=50))
    trainer.train()

Every ``snapshot_every`` optimizer steps the whole training state goes into RAM: the model,
the optimizer, the LR scheduler, the GradScaler where mixed precision uses one, every global
RNG, and the Trainer's own state (``global_step``, ``log_history``, best metric, stateful
callbacks, the loss accumulated since the last log). ``trainer.train()`` then loads the newest
verified snapshot by itself and goes on at the same step and batch, exactly as the Trainer's
own ``resume_from_checkpoint`` would from a folder, but from RAM.

A callback alone cannot move where ``train()`` starts, so :func:`attach` also takes over the
Trainer's loading hooks (``_load_*``, ``_init_training_state``) and the end of its step
(``_maybe_log_save_evaluate``: a snapshot is taken after a step's logging and evaluation, as
the Trainer's own checkpoints are). These are private Trainer methods: the ``hf`` extra pins
the transformers versions this is tested with.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_callback import ExportableState, TrainerState
from transformers.trainer_utils import get_last_checkpoint

from memckpt.errors import StateError
from memckpt.format.state import TrainState, rng_state, set_rng_state
from memckpt.integrations.saver import Saver

log = logging.getLogger("memckpt")

MEMCKPT = "memckpt"  # where the resumed state came from
FOLDER = "folder"


def check_trainer(trainer: Any) -> None:
    """Refuse, before the first step, what the integration cannot capture exactly."""
    where = "memckpt.integrations.hf.attach"
    if not isinstance(trainer, Trainer):
        raise StateError(f"{where} needs a transformers.Trainer, got {type(trainer).__name__}")
    if getattr(trainer, "is_deepspeed_enabled", False):
        raise StateError(f"{where}: a DeepSpeed engine's state is not captured; train without "
                         "TrainingArguments(deepspeed=...) (DDP), or use DeepSpeed's own checkpoints")
    if getattr(trainer, "is_fsdp_enabled", False):
        raise StateError(f"{where}: FSDP under the Trainer is not captured yet; use DDP, or "
                         "memckpt.run with FSDP2 in your own loop (see docs/universal-state.md)")
    if trainer.model_init is not None:
        raise StateError(f"{where}: model_init re-creates the model inside train(); pass "
                         "Trainer(model=...) instead")


def torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's wrapper; anything else is refused by name."""
    inner = getattr(opt, "optimizer", opt) if type(opt).__name__ == "AcceleratedOptimizer" else opt
    if not isinstance(inner, torch.optim.Optimizer):
        raise StateError(f"memckpt cannot capture the optimizer {type(inner).__module__}."
                         f"{type(inner).__name__}: it is not a torch.optim.Optimizer; pass a torch "
                         "optimizer to Trainer(optimizers=...) or leave the Trainer's default")
    return inner


class HFSnapshots(TrainerCallback):
    """Takes the snapshots and serves the Trainer's resume from them (see the module doc)."""

    def __init__(self, trainer: Trainer, target: Any) -> None:
        check_trainer(trainer)
        self.trainer = trainer
        self.saver = Saver(target, trainer.args.process_index, trainer.args.world_size,
                           who="memckpt.integrations.hf.attach")
        # train() reads a trainer_state.json from the folder it resumes from: this rank's own
        self.marker = Path(trainer.args.output_dir) / ".memckpt-resume" / f"rank{trainer.args.process_index}"
        self.folder: Optional[str] = None
        self.source: Optional[str] = None
        self.restored_step = 0
        self.loaded: dict[str, Any] = {}  # what the Trainer re-applies after it rebuilt things
        self.last = -1  # the global step last handed to the saver
        self.epoch_ended = False
        self.steps_per_epoch = 0
        self.original = {name: getattr(trainer, name) for name in (
            "train", "_init_training_state", "_load_from_checkpoint",
            "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state",
            "_maybe_log_save_evaluate")}
        trainer.train = self.train
        trainer._init_training_state = self.init_training_state
        trainer._load_from_checkpoint = self.load_from_checkpoint
        trainer._load_optimizer_and_scheduler = self.load_optimizer_and_scheduler
        trainer._load_scaler = self.load_scaler
        trainer._load_rng_state = self.load_rng_state
        trainer._maybe_log_save_evaluate = self.maybe_log_save_evaluate
        trainer.add_callback(self)

    # -- what a snapshot holds ----------------------------------------------------------------
    def state(self) -> TrainState:
        t = self.trainer
        model = getattr(t.model, "_orig_mod", t.model)  # a torch.compile'd model's own module
        return TrainState(model=model, optimizer=torch_optimizer(t.optimizer),
                          scheduler=t.lr_scheduler, scaler=getattr(t.accelerator, "scaler", None),
                          extras=self.extras())

    def extras(self) -> dict[str, Any]:
        t = self.trainer
        trainer_state = dataclasses.asdict(t.state)
        callbacks = dict(trainer_state.get("stateful_callbacks") or {})
        for cb in t.callback_handler.callbacks + [t.control]:  # as the Trainer's own save does
            if isinstance(cb, ExportableState):
                callbacks[type(cb).__name__] = cb.state()
        trainer_state["stateful_callbacks"] = callbacks
        loss = getattr(t, "_tr_loss", None)
        return {"trainer_state": trainer_state,
                "loop": {"tr_loss": float(loss) if loss is not None else 0.0,
                         "total_loss": getattr(t, "_total_loss_scalar", 0.0),
                         "last_logged": getattr(t, "_globalstep_last_logged", 0),
                         # the run's first step: its summary's train_loss averages from there
                         "initial_step": getattr(t, "_initial_global_step", 0),
                         "flos": float(getattr(t, "current_flos", 0.0))},
                "data": {"seed": self.data_seed(), "steps_per_epoch": self.steps_per_epoch,
                         "world_size": t.args.world_size}}

    def data_seed(self) -> int:
        args = self.trainer.args
        return args.data_seed if args.data_seed is not None else args.seed

    # -- train() and the Trainer's resume hooks -----------------------------------------------
    def train(self, resume_from_checkpoint: Any = None, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming from memckpt's newest snapshot unless the folder the
        caller names (or ``True``: the newest in ``output_dir``) holds a newer step."""
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.trainer.args.output_dir)
        self.folder = resume_from_checkpoint or None
        self.source, self.restored_step, self.last = None, 0, -1
        self.marker.mkdir(parents=True, exist_ok=True)
        TrainerState().save_to_json(str(self.marker / TRAINER_STATE_NAME))  # train() reads one
        try:
            out = self.original["train"](resume_from_checkpoint=str(self.marker), **kwargs)
        except BaseException:
            self.saver.failed()
            raise
        self.saver.finished()
        return out

    def load_from_checkpoint(self, checkpoint: str, model: Any = None) -> None:
        if self.folder is not None:  # memckpt's snapshot, if newer, replaces it afterwards
            self.original["_load_from_checkpoint"](self.folder, model)

    def init_training_state(self, max_steps: int, steps_per_epoch: int, epochs: int,
                            resume_from_checkpoint: Any, trial: Any) -> tuple[int, int]:
        t = self.trainer
        self.steps_per_epoch = steps_per_epoch
        if t.optimizer is None:  # the restore needs them; the Trainer keeps the optimizer
            t.create_optimizer()
        if t.lr_scheduler is None:
            t.create_scheduler(num_training_steps=max_steps, optimizer=t.optimizer)
        step = self.saver.restore(self.state_for_restore())
        state_file = self.marker / TRAINER_STATE_NAME
        path: Optional[str] = str(self.marker)
        if step and (self.folder is None or step >= folder_step(self.folder)):
            self.source, self.restored_step = MEMCKPT, step
            self.adopt(steps_per_epoch, max_steps)
            state_file.write_text(json.dumps(self.restoring.extras["trainer_state"]))
        else:
            state_file.unlink(missing_ok=True)
            if self.folder is not None:
                self.source, path = FOLDER, self.folder
                if step:  # the folder is newer: its weights again over the snapshot's
                    log.warning("memckpt: %s (step %d) is newer than memckpt's snapshot (step %d): "
                                "resuming from the folder", self.folder, folder_step(self.folder), step)
                    self.original["_load_from_checkpoint"](self.folder)
        return self.original["_init_training_state"](max_steps, steps_per_epoch, epochs, path, trial)

    def state_for_restore(self) -> TrainState:
        self.restoring = self.state()
        return self.restoring

    def adopt(self, steps_per_epoch: int, max_steps: int) -> None:
        """Check the restored data position and keep what the Trainer rebuilds after this."""
        data = self.restoring.extras.get("data", {})
        if data.get("steps_per_epoch") != steps_per_epoch or data.get("seed") != self.data_seed():
            raise StateError(
                f"memckpt's snapshot of step {self.restored_step} was taken with "
                f"{data.get('steps_per_epoch')} optimizer steps per epoch and data seed "
                f"{data.get('seed')}, this run has "
                f"{steps_per_epoch} and {self.data_seed()}: the dataset, batch size or seed changed; "
                "restore them, or give the run a new job_name to start fresh")
        opt = torch_optimizer(self.trainer.optimizer)
        self.loaded = {"rng": rng_state(), "scheduler": self.trainer.lr_scheduler.state_dict(),
                       "groups": [{k: v for k, v in g.items() if k != "params"}
                                  for g in opt.param_groups]}
        log.warning("memckpt: resumed from the RAM snapshot of step %d (job %r)",
                    self.restored_step, self.saver.config.job_name)
        if self.restored_step >= max_steps:
            log.warning("memckpt: job %r already finished at step %d: train() has nothing left to "
                        "do; give the run a new job_name to train again", self.saver.config.job_name,
                        self.restored_step)

    def load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        if self.source == FOLDER:
            self.original["_load_optimizer_and_scheduler"](self.folder)
        elif self.source == MEMCKPT:  # the Trainer re-created its scheduler after the restore
            t = self.trainer
            t.lr_scheduler.load_state_dict(self.loaded["scheduler"])
            for group, saved in zip(torch_optimizer(t.optimizer).param_groups, self.loaded["groups"]):
                group.update(saved)

    def load_scaler(self, checkpoint: Any) -> None:
        if self.source == FOLDER:
            self.original["_load_scaler"](self.folder)

    def load_rng_state(self, checkpoint: Any) -> None:
        """Called after the Trainer skipped the batches already trained (which draws from
        the RNG): the snapshot's RNG goes back then, as the Trainer's own resume does."""
        if self.source == FOLDER:
            self.original["_load_rng_state"](self.folder)
        elif self.source == MEMCKPT:
            set_rng_state(self.loaded["rng"])

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # the Trainer resets its loss bookkeeping just before this event
        if self.source == MEMCKPT:
            t, loop = self.trainer, self.restoring.extras["loop"]
            t._tr_loss = torch.tensor(loop["tr_loss"], device=args.device)
            t._total_loss_scalar = loop["total_loss"]
            t._globalstep_last_logged = loop["last_logged"]
            t._initial_global_step = loop.get("initial_step", 0)
            t.current_flos = loop["flos"]

    # -- taking snapshots -----------------------------------------------------------------------
    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.epoch_ended = False

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.epoch_ended = True

    def maybe_log_save_evaluate(self, *args: Any, **kwargs: Any) -> None:
        """The end of a step: its logging, evaluation and save; then the snapshot. The last
        step of an epoch is snapshotted after the epoch's own evaluation, the next call."""
        self.original["_maybe_log_save_evaluate"](*args, **kwargs)
        state = self.trainer.state
        step = state.global_step
        if step == self.last or step == 0:
            return
        if state.epoch is not None and float(state.epoch).is_integer() and not self.epoch_ended:
            return  # the epoch's end comes next, with this same step
        self.last = step
        self.saver.step(self.state(), step, **logged_loss(state.log_history, step))


def logged_loss(log_history: list[dict[str, Any]], step: int) -> dict[str, float]:
    """``{"loss": ...}`` when the Trainer logged a training loss at ``step`` (every step with
    ``logging_steps=1``; its value is averaged over the ranks and the steps since the last
    log), else nothing: what the step reports to memckpt.run's coordinator."""
    for entry in reversed(log_history):
        if entry.get("step") != step:
            break
        if "loss" in entry:
            return {"loss": float(entry["loss"])}
    return {}


def folder_step(folder: str) -> int:
    """The global step of a Trainer checkpoint folder (0 if it has no trainer_state.json)."""
    path = Path(folder) / TRAINER_STATE_NAME
    return int(json.loads(path.read_text()).get("global_step", 0)) if path.is_file() else 0


def attach(trainer: Trainer, target: Any) -> HFSnapshots:
    """Make ``trainer.train()`` snapshot into RAM and resume from memckpt by itself.

    ``target``: a :class:`memckpt.Config` (one process), the ``ctx`` of ``memckpt.run``, or
    ``memckpt.ray_train.context()``. Raises :class:`memckpt.MemckptError` naming what it
    cannot capture (DeepSpeed, FSDP, ``model_init``; an optimizer that is not a torch
    optimizer at the first step)."""
    return HFSnapshots(trainer, target)
