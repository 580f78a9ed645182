"""Helper process for tests/test_integration_hf.py (not a test module).

Runs examples/hf_trainer.py's Trainer (a tiny GPT-2 from its config, dropout on, a shuffled
dataset, evaluation every 4 steps) with memckpt attached. With ``--kill-at S`` the process
SIGKILLs itself at the end of optimizer step S. Writes ``<out>/result.json`` (log_history,
the step it resumed from) and ``<out>/weights.pt``.

    python tests/_hf_job.py --ram-root R --job J --out O [--accum 2] [--kill-at S]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import TrainerCallback

from memckpt.integrations.hf import attach

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _integration_args import kill_self_at, parse  # noqa: E402
from hf_trainer import build  # noqa: E402


class KillAt(TrainerCallback):
    """SIGKILL this process once optimizer step ``step`` has ended (as a crash would)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.landed = lambda: None  # the Checkpointer's wait, once attach() made it

    def on_step_end(self, args, state, control, **kwargs):
        kill_self_at(self.step, state.global_step, self.landed)


def main() -> None:
    a, out, config = parse()
    kill = [KillAt(a.kill_at)] if a.kill_at else []
    trainer = build(str(out / "trainer"), a.accum, kill or None)
    hooks = attach(trainer, config)
    for k in kill:
        k.landed = hooks.saver.inner.wait
    trainer.train()
    (out / "result.json").write_text(json.dumps({"log_history": trainer.state.log_history,
                                                 "resumed_from": hooks.restored_step}))
    torch.save({k: v.clone() for k, v in trainer.model.state_dict().items()}, out / "weights.pt")


if __name__ == "__main__":
    main()
