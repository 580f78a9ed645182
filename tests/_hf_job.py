"""Helper process for tests/test_integration_hf.py (not a test module).

One Hugging Face Trainer run of a tiny GPT-2 built from its config (no download), dropout
on, a shuffled dataset, evaluation every 4 steps, with memckpt attached in two lines. With
``--kill-at S`` the process SIGKILLs itself at the end of optimizer step S (mid-epoch).
Writes ``<out>/result.json`` (log_history, the step it resumed from) and ``<out>/weights.pt``.

    python tests/_hf_job.py --ram-root R --job J --out O [--accum 2] [--kill-at S]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import memckpt
from memckpt.integrations.hf import attach

SEQ, VOCAB = 16, 64


class Tokens(Dataset):
    """Fixed random token sequences (their own generator: the global RNG is the Trainer's)."""

    def __init__(self, n: int, seed: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class KillAt(TrainerCallback):
    """SIGKILL this process once optimizer step ``step`` has ended (as a crash would)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
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
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2,
                                       n_head=2, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1))
    args = TrainingArguments(
        output_dir=str(out / "trainer"), per_device_train_batch_size=4,
        gradient_accumulation_steps=a.accum, num_train_epochs=2, learning_rate=1e-3,
        warmup_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=4,
        per_device_eval_batch_size=8, save_strategy="no", report_to=[], seed=0,
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(24, 1), eval_dataset=Tokens(8, 2),
                      callbacks=[KillAt(a.kill_at)] if a.kill_at else [])
    hooks = attach(trainer, memckpt.Config(job_name=a.job, ram_root=a.ram_root, snapshot_every=a.every))
    trainer.train()
    (out / "result.json").write_text(json.dumps({"log_history": trainer.state.log_history,
                                                 "resumed_from": hooks.restored_step}))
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
