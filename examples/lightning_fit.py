"""A Lightning ``fit()`` with memckpt: RAM snapshots, and a ``fit()`` that resumes by itself
at the next batch after the process is killed. The memckpt lines are marked.

    python examples/lightning_fit.py [--accum N] [--every N]

A small dropout MLP on a fixed regression set in a shuffled order, AdamW with a per-step LR
schedule, two epochs. Kill it (``kill -9``) while it trains and run the same command again.
tests/test_integration_lightning.py runs this script's ``build`` (and, with 3 ranks under
``memckpt.run``, ``build`` and ``trainer_for(..., num_nodes=ctx.world_size)`` on every rank;
inside Ray Train, ``trainer_for(..., ray_train=True)``).
"""

from __future__ import annotations

import argparse

import lightning.pytorch as L
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import memckpt
from memckpt.integrations.lightning import MemckptCallback  # memckpt (1/2)


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


def build(samples: int = 40) -> tuple[Net, DataLoader, memckpt.ResumableSampler]:
    g = torch.Generator().manual_seed(7)
    data = TensorDataset(torch.randn(samples, 8, generator=g), torch.randn(samples, 1, generator=g))
    L.seed_everything(0, verbose=False)
    sampler = memckpt.ResumableSampler(len(data), seed=3)  # in place of shuffle=True
    return Net(), DataLoader(data, batch_size=4, sampler=sampler), sampler


def trainer_for(callbacks: list, accum: int = 1, num_nodes: int = 1,
                ray_train: bool = False) -> L.Trainer:
    """``num_nodes``: ``ctx.world_size`` under ``memckpt.run`` (DDP over its process group, a
    device per rank; find_unused_parameters keeps DDP's gradient buckets in one layout, for a
    bit-identical resume). ``ray_train``: inside Ray Train's ``train_loop_per_worker``, Ray's
    DDP strategy and environment over the process group Ray Train made, as Ray's guide has
    it. The ResumableSampler, not Lightning's DistributedSampler, deals the data to the ranks."""
    common = dict(max_epochs=2, accumulate_grad_batches=accum, callbacks=callbacks,
                  accelerator="cpu", devices=1, use_distributed_sampler=False, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False)
    if ray_train:
        from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, prepare_trainer
        return prepare_trainer(L.Trainer(strategy=RayDDPStrategy(find_unused_parameters=True),
                                         plugins=[RayLightningEnvironment()], **common))
    return L.Trainer(num_nodes=num_nodes,
                     strategy="ddp_find_unused_parameters_true" if num_nodes > 1 else "auto",
                     **common)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--every", type=int, default=2, help="snapshot every N optimizer steps")
    a = p.parse_args()
    model, loader, sampler = build()
    config = memckpt.Config(job_name="lightning-example", snapshot_every=a.every)
    trainer = trainer_for([MemckptCallback(config, sampler)], a.accum)  # memckpt (2/2)
    trainer.fit(model, loader)
    print("final step", trainer.global_step)


if __name__ == "__main__":
    main()
