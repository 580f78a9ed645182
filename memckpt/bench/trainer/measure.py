"""The child processes of ``memckpt bench trainer`` (one job each; JSON to ``--out``).

    python -m memckpt.bench.trainer.measure --phase steps|snapshot-and-kill|resume \
        --method hf-save|hf-save-warm|memckpt --size BYTES --steps N --dir DIR --ram-root DIR \
        --out FILE

``steps``: trains ``--steps`` optimizer steps three times in this process (no checkpoint, the
Trainer's ``save_steps=1``, memckpt in overlap mode; a fresh Trainer each) and reports each
step's wall time and the time each step blocked in its checkpoint call.
``snapshot-and-kill``: the same with memckpt every step, then SIGKILL once the last snapshot
is sealed (as a crash would).
``resume``: a fresh process resumes one more step, from the Trainer's last folder
(``resume_from_checkpoint``) or from memckpt's RAM snapshot; reports the restore part and the
wall-clock time of the first resumed step's start (the parent started the clock at spawn).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import memckpt
from memckpt.bench.common import evict_from_page_cache
from memckpt.integrations.hf import attach

SEQ, VOCAB, LAYERS, HEAD = 32, 256, 4, 64
BYTES_PER_PARAM = 12  # fp32 parameter + AdamW's exp_avg and exp_avg_sq
LOADS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")


def width(state_bytes: int) -> int:
    """The GPT-2 width whose model + AdamW state is about ``state_bytes`` (4 layers: ~12 d^2
    parameters each), in whole attention heads."""
    d = math.sqrt(state_bytes / BYTES_PER_PARAM / (12 * LAYERS))
    return max(HEAD, int(round(d / HEAD)) * HEAD)


class Tokens(Dataset):
    def __init__(self, n: int) -> None:
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Clock(TrainerCallback):
    """The wall-clock time each optimizer step began at."""

    def __init__(self) -> None:
        self.begins: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.begins.append(time.time())


def gpt2(size: int) -> GPT2LMHeadModel:
    """The benchmark's GPT-2, seeded: model + AdamW state about ``size`` bytes."""
    torch.manual_seed(0)
    d = width(size)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=d, n_layer=LAYERS,
                                      n_head=d // HEAD, bos_token_id=VOCAB - 1,
                                      eos_token_id=VOCAB - 1))


def build(out: str, size: int, steps: int, save: bool) -> tuple[Trainer, Clock]:
    model = gpt2(size)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=steps,
                             learning_rate=1e-4, save_strategy="steps" if save else "no",
                             save_steps=1, save_total_limit=1, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=0, dataloader_num_workers=0,
                             logging_strategy="no")
    clock = Clock()
    return Trainer(model=model, args=args, train_dataset=Tokens(64), callbacks=[clock]), clock


def timed(obj: Any, name: str, into: list[float]) -> None:
    """Record the duration of every call of ``obj.name`` in ``into``."""
    inner: Callable[..., Any] = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - t0)
    setattr(obj, name, wrapper)


def overlap_blocking(saver: Any, into: list[float]) -> None:
    """Per step, the time an overlap-mode snapshot blocked it: the ``step`` call (the small
    tensors) plus the optimizer's wait for the previous snapshot's background copy."""
    engine, step_fn, wait_fn = saver.inner.engine, saver.step, saver.inner.engine.wait_copy
    waited = [0.0]

    def wait_copy() -> None:
        t0 = time.perf_counter()
        try:
            wait_fn()
        finally:
            waited[0] += time.perf_counter() - t0

    def step(state: Any, n: int) -> None:
        t0 = time.perf_counter()
        step_fn(state, n)
        into.append(time.perf_counter() - t0 + waited[0])
        waited[0] = 0.0
    engine.wait_copy = wait_copy
    saver.step = step


def state_bytes(model: torch.nn.Module) -> int:
    """The model's parameters + AdamW's two moments."""
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters())


def run_steps(method: str, size: int, steps: int, directory: Path, ram_root: str,
              kill_after: Optional[Path] = None) -> dict[str, Any]:
    """``kill_after``: memckpt only; once the last step's snapshot is sealed (what the resume
    will find), write the figures there and SIGKILL this process."""
    trainer, clock = build(str(directory / method), size, steps, save=method == "hf-save")
    blocking: list[float] = []
    t0 = time.time()

    def figures(ended: bool = True) -> dict[str, Any]:  # the last step ended, or not yet
        ends = clock.begins[1:] + ([time.time()] if ended else [])
        return {"method": method, "state_bytes": state_bytes(trainer.model), "width": width(size),
                "step_s": [e - b for b, e in zip(clock.begins, ends)], "blocking_s": blocking,
                "train_s": time.time() - t0}

    if method == "hf-save":
        timed(trainer, "_save_checkpoint", blocking)
    elif method == "memckpt-overlap":
        hooks = attach(trainer, memckpt.Config(job_name="bench-trainer-overlap", ram_root=ram_root,
                                               snapshot_mode="overlap"))
        overlap_blocking(hooks.saver, blocking)
    elif method == "memckpt":
        hooks = attach(trainer, memckpt.Config(job_name="bench-trainer", ram_root=ram_root))
        timed(hooks.saver, "step", blocking)
        if kill_after is not None:
            saver, step_fn = hooks.saver, hooks.saver.step
            assert isinstance(saver.inner, memckpt.Checkpointer)  # made here from a Config
            wait = saver.inner.wait

            def last(state: Any, step: int, **metrics: float) -> None:
                step_fn(state, step, **metrics)
                if step == steps:
                    wait()
                    kill_after.write_text(json.dumps(figures(ended=False)))
                    os.kill(os.getpid(), signal.SIGKILL)
            saver.step = last  # type: ignore[method-assign]
    trainer.train()
    return figures()


def resume(method: str, size: int, steps: int, directory: Path, ram_root: str) -> dict[str, Any]:
    """One more step after ``steps``, resumed by ``method``: memckpt, or the Trainer from its
    last folder read from the disk (``hf-save``: its pages dropped from the page cache first)
    or from the page cache it was written through (``hf-save-warm``)."""
    saved = directory / "hf-save" / f"checkpoint-{steps}"  # the save_steps run's last folder
    if method == "hf-save":
        evict_from_page_cache(saved)
    trainer, clock = build(str(directory / method), size, steps + 1, save=False)
    loads: list[float] = []
    folder: Optional[str] = None
    if method == "memckpt":
        hooks = attach(trainer, memckpt.Config(job_name="bench-trainer", ram_root=ram_root))
        timed(hooks.saver, "restore", loads)
    else:
        folder = str(saved)
        for name in LOADS:
            timed(trainer, name, loads)
    trainer.train(resume_from_checkpoint=folder)
    resumed = hooks.restored_step if method == "memckpt" else trainer.state.global_step - 1
    return {"method": method, "restore_s": sum(loads), "first_step_at": clock.begins[0],
            "resumed_step": resumed, "state_bytes": state_bytes(trainer.model)}


def child_arguments(p: argparse.ArgumentParser) -> argparse.Namespace:
    """The arguments every child of the benchmark takes, parsed; torch on every core."""
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--ram-root", required=True)
    p.add_argument("--out", required=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    return p.parse_args()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--phase", choices=("steps", "snapshot-and-kill", "resume"), required=True)
    p.add_argument("--method", choices=("hf-save", "hf-save-warm", "memckpt"), default="memckpt")
    a = child_arguments(p)
    directory = Path(a.dir)
    if a.phase == "steps":
        result: Any = [run_steps(m, a.size, a.steps, directory, a.ram_root)
                       for m in ("none", "hf-save", "memckpt-overlap")]
    elif a.phase == "snapshot-and-kill":
        run_steps("memckpt", a.size, a.steps, directory, a.ram_root, kill_after=Path(a.out))
        raise SystemExit("the snapshot-and-kill run was not killed")
    else:
        result = resume(a.method, a.size, a.steps, directory, a.ram_root)
    Path(a.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
