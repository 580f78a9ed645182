"""``memckpt bench trainer``'s Lightning child: measure.py's GPT-2, fit by Lightning three
times in this process (a fresh Trainer each), ``--steps`` optimizer steps each:

  lightning-none        no checkpoint: the step time the others are compared with
  lightning-checkpoint  ``ModelCheckpoint(every_n_train_steps=1)``: Lightning's own
                        checkpoint file every step (the newest kept, as ``save_top_k=1``)
  lightning-memckpt     memckpt's ``MemckptCallback``, a snapshot every step

    python -m memckpt.bench.trainer.measure_lightning --size BYTES --steps N --dir DIR \\
        --ram-root DIR --out FILE

Per run: each step's wall time and the time each step blocked in its checkpoint callback's
``on_train_batch_end`` (where both save). Needs the ``lightning`` extra.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

import memckpt
from memckpt.bench.trainer.measure import Tokens, child_arguments, gpt2, state_bytes, timed
from memckpt.integrations.lightning import MemckptCallback

METHODS = ("lightning-none", "lightning-checkpoint", "lightning-memckpt")


class Module(L.LightningModule):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.model = gpt2(size)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class Clock(Callback):
    """The wall-clock time each optimizer step began at."""

    def __init__(self) -> None:
        self.begins: list[float] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.begins.append(time.time())


def run(method: str, size: int, steps: int, directory: Path, ram_root: str) -> dict[str, Any]:
    module, clock = Module(size), Clock()
    blocking: list[float] = []
    sampler = memckpt.ResumableSampler(64, seed=0)
    callbacks: list[Callback] = [clock]
    if method == "lightning-checkpoint":
        callbacks.append(ModelCheckpoint(dirpath=directory / method, every_n_train_steps=1))
    elif method == "lightning-memckpt":
        callbacks.append(MemckptCallback(
            memckpt.Config(job_name="bench-trainer-lightning", ram_root=ram_root), sampler))
    for cb in callbacks[1:]:
        timed(cb, "on_train_batch_end", blocking)
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks,
                        enable_checkpointing=method == "lightning-checkpoint", logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, DataLoader(Tokens(64), batch_size=2, sampler=sampler))
    ends = clock.begins[1:] + [time.time()]
    return {"method": method, "state_bytes": state_bytes(module),
            "step_s": [e - b for b, e in zip(clock.begins, ends)], "blocking_s": blocking}


def main() -> None:
    a = child_arguments(argparse.ArgumentParser())
    result = [run(m, a.size, a.steps, Path(a.dir), a.ram_root) for m in METHODS]
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
