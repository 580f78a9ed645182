"""A Hugging Face ``Trainer`` script with memckpt: RAM snapshots, and a ``train()`` that
resumes by itself after the process is killed. The memckpt lines are marked.

    python examples/hf_trainer.py [--out DIR] [--accum N] [--every N]

A tiny GPT-2 built from its config (no download), dropout on, a shuffled dataset, evaluation
every 4 steps. Kill it (``kill -9``) while it trains, run the same command again: it prints
``memckpt: resumed from the RAM snapshot of step N`` and ends with the same weights as a run
that never stopped. tests/test_integration_hf.py runs this script's ``build``.
"""

from __future__ import annotations

import argparse
from typing import Optional

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import memckpt
from memckpt.integrations.hf import attach  # memckpt (1/2)

SEQ, VOCAB = 16, 64


class Tokens(Dataset):
    """Fixed random token sequences (their own generator: the global RNG is the Trainer's)."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def build(out: str, accum: int = 1, callbacks: Optional[list[TrainerCallback]] = None,
          samples: int = 24) -> Trainer:
    """The Trainer as any script would make it: nothing memckpt here. Under several ranks
    (DDP), each optimizer step takes 4 samples per rank."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=4, gradient_accumulation_steps=accum,
        num_train_epochs=2, learning_rate=1e-3, warmup_steps=2, logging_steps=1,
        eval_strategy="steps", eval_steps=4, per_device_eval_batch_size=8, save_strategy="no",
        report_to=[], seed=0, use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    return Trainer(model=model, args=args, train_dataset=Tokens(samples, 1), eval_dataset=Tokens(8, 2),
                   callbacks=callbacks)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="hf_trainer_out")
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--every", type=int, default=2, help="snapshot every N optimizer steps")
    a = p.parse_args()
    trainer = build(a.out, a.accum)
    attach(trainer, memckpt.Config(job_name="hf-example", snapshot_every=a.every))  # memckpt (2/2)
    trainer.train()
    print("final loss", trainer.state.log_history[-2].get("loss"))


if __name__ == "__main__":
    main()
