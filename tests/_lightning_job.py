"""Helper process for tests/test_integration_lightning.py (not a test module).

One ``lightning`` fit of a small dropout MLP on a fixed regression set drawn in a shuffled
order (memckpt.ResumableSampler), AdamW with a step LR schedule, memckpt's callback attached.
With ``--kill-at S`` the process SIGKILLs itself at the end of optimizer step S. Writes
``<out>/result.json`` (per-batch losses, the step it resumed from) and ``<out>/weights.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import lightning.pytorch as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import memckpt
from memckpt.integrations.lightning import MemckptCallback


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
        self.losses: dict[str, float] = {}  # "epoch:batch" -> loss

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[f"{self.current_epoch}:{batch_idx}"] = loss.item()
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 3, 0.5),
                                 "interval": "step"}}


class KillAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:  # memckpt's callback ran first (listed first)
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ram-root", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--every", type=int, default=2)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(40, 8, generator=g), torch.randn(40, 1, generator=g))
    L.seed_everything(0, verbose=False)
    model = Net()
    sampler = memckpt.ResumableSampler(len(data), seed=3)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    callbacks = [MemckptCallback(memckpt.Config(job_name=a.job, ram_root=a.ram_root,
                                                snapshot_every=a.every), sampler)]
    if a.kill_at:
        callbacks.append(KillAt(a.kill_at))
    trainer = L.Trainer(max_epochs=2, accumulate_grad_batches=a.accum, callbacks=callbacks,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    (out / "result.json").write_text(json.dumps({"losses": model.losses,
                                                 "resumed_from": callbacks[0].restored_step}))
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
