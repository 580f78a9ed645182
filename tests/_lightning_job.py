"""Helper process for tests/test_integration_lightning.py (not a test module).

Runs examples/lightning_fit.py's fit (a dropout MLP, a shuffled ResumableSampler, AdamW with
a per-step LR schedule) with memckpt's callback. With ``--kill-at S`` the process SIGKILLs
itself at the end of optimizer step S. Writes ``<out>/result.json`` (per-batch losses, the
step it resumed from) and ``<out>/weights.pt``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as L
import torch

from memckpt.integrations.lightning import MemckptCallback

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _integration_args import kill_self_at, parse  # noqa: E402
from lightning_fit import build, trainer_for  # noqa: E402


class KillAt(L.Callback):
    def __init__(self, step: int, memckpt: MemckptCallback) -> None:
        self.step, self.memckpt = step, memckpt

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        assert self.memckpt.saver is not None  # memckpt's callback ran first
        kill_self_at(self.step, trainer.global_step, self.memckpt.saver.inner.wait)


def main() -> None:
    a, out, config = parse()
    model, loader, sampler = build()
    callbacks = [MemckptCallback(config, sampler)]
    if a.kill_at:
        callbacks.append(KillAt(a.kill_at, callbacks[0]))
    trainer_for(callbacks, a.accum).fit(model, loader)
    (out / "result.json").write_text(json.dumps({"losses": model.losses,
                                                 "resumed_from": callbacks[0].restored_step}))
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
