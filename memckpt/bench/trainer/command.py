"""The Hugging Face Trainer's own checkpoint every step vs memckpt's snapshot every step.

A GPT-2 built from its config (4 layers, sized so model + AdamW state is about each size),
trained by ``transformers.Trainer`` on the CPU (or the first GPU), measured in the same run:

  step      none          no checkpoint: the step time the others are compared with
            hf-save       TrainingArguments(save_strategy="steps", save_steps=1): the Trainer's
                          own checkpoint folder every step (safetensors + optimizer.pt ...)
            memckpt       memckpt.integrations.hf.attach, a snapshot every step
            memckpt-overlap  the same with Config(snapshot_mode="overlap"): the parameters
                          and optimizer state are copied while the next step's forward and
                          backward run; blocked = the step call plus the optimizer's wait
            lightning-*   the same model fit by Lightning: no checkpoint,
                          ModelCheckpoint(every_n_train_steps=1), and memckpt's
                          MemckptCallback every step (when lightning is installed)
  resume    hf-resume     a fresh process: train(resume_from_checkpoint=<last folder>), the
                          folder read from the disk (its pages dropped from the page cache, as
                          after a reboot or on a replacement node)
            hf-resume-warm  the same, read from the page cache it was just written through
                          (a process restarted on the same node soon after the save)
            memckpt       a fresh process after the memckpt run was SIGKILLed: train() resumes
                          from the RAM snapshot by itself

Per step: the time the step blocked in the checkpoint call (``blocking``: _save_checkpoint,
or memckpt's step) and the whole step time (medians after the first step). Per resume: the
restore part (the Trainer's _load_* hooks, or memckpt's restore) and the time from the
process's start to its first resumed step (interpreter, imports and model build included:
both pay them).

Each measurement is a fresh process. Sizes are binary: 100M = 100 MiB, 1G = 1 GiB. Needs the
``hf`` extra (transformers); the Lightning rows need the ``lightning`` extra.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from memckpt.bench.common import (disk_dir, machine_info, parse_sizes, positive_int, ram_dir,
                                  rows_from_child, standalone, write_rows)
from memckpt.bench.trainer.report import ratios, report, steady

DEFAULT_SIZES = "100M,1G"
CHILD = "memckpt.bench.trainer.measure"
LIGHTNING_CHILD = "memckpt.bench.trainer.measure_lightning"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        metavar="LIST", help=f"state sizes, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--steps", type=positive_int, default=5, metavar="N",
                        help="optimizer steps per run (default 5; the first is warm-up)")
    parser.add_argument("--dir", metavar="DIR", default=None,
                        help="directory for the Trainer's checkpoint folders (default: a temp dir "
                             "on local disk)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as a JSON list to PATH")


def _say(msg: str) -> None:
    print(f"[bench trainer] {msg}", file=sys.stderr, flush=True)


def _child(phase: str, size: int, steps: int, directory: Path, ram: Path,
           method: str = "memckpt") -> Any:
    args = ["--phase", phase, "--method", method, "--size", str(size), "--steps", str(steps),
            "--dir", str(directory), "--ram-root", str(ram)]
    if phase != "snapshot-and-kill":
        return rows_from_child(CHILD, args, "--out", f"bench trainer {phase} {method}")
    out = directory / "killed.json"  # the child writes it, then SIGKILLs itself
    done = subprocess.run([sys.executable, "-m", CHILD, *args, "--out", str(out)],
                          stdout=subprocess.DEVNULL)  # the Trainer's prints; errors go to stderr
    if done.returncode != -9 or not out.is_file():
        raise RuntimeError(f"bench trainer: the memckpt run ended with {done.returncode}, "
                           "not SIGKILL after its last snapshot")
    return json.loads(out.read_text())


def _has_lightning() -> bool:
    try:
        import lightning  # noqa: F401
    except ImportError:
        return False
    return True


def _step_rows(label: str, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run of one framework; the first run (no checkpoint) is the baseline."""
    none_s = steady(runs[0]["step_s"])
    rows = []
    for r in runs:
        step_s = steady(r["step_s"])
        rows.append({"benchmark": "step", "size": label, "method": r["method"],
                     "state_bytes": r["state_bytes"], "step_s": step_s,
                     "blocking_s": steady(r["blocking_s"]) if r["blocking_s"] else 0.0,
                     "overhead_s": step_s - none_s, "steps": len(r["step_s"])})
    return rows


def measure_size(label: str, size: int, steps: int, base: Optional[str]) -> list[dict[str, Any]]:
    directory, ram = disk_dir(base, "memckpt-bench-trainer-"), ram_dir("memckpt-bench-trainer-")
    try:
        _say(f"{label}: no checkpoint, the Trainer's save_steps=1, memckpt in overlap mode "
             f"({steps} steps each)")
        runs = _child("steps", size, steps, directory, ram)
        _say(f"{label}: memckpt every step, then SIGKILL")
        runs.append(_child("snapshot-and-kill", size, steps, directory, ram))
        rows = _step_rows(label, runs)
        for method in ("hf-save-warm", "hf-save", "memckpt"):
            _say(f"{label}: resume by {method} in a fresh process")
            started = time.time()
            r = _child("resume", size, steps, directory, ram, method)
            rows.append({"benchmark": "resume", "size": label,
                         "method": method.replace("hf-save", "hf-resume"),
                         "state_bytes": r["state_bytes"], "restore_s": r["restore_s"],
                         "to_first_step_s": r["first_step_at"] - started,
                         "resumed_step": r["resumed_step"]})
        if _has_lightning():
            _say(f"{label}: Lightning: no checkpoint, ModelCheckpoint(every_n_train_steps=1), "
                 f"memckpt every step ({steps} steps each)")
            rows += _step_rows(label, rows_from_child(
                LIGHTNING_CHILD, ["--size", str(size), "--steps", str(steps), "--dir",
                                  str(directory), "--ram-root", str(ram)],
                "--out", "bench trainer lightning"))
        else:
            _say(f"{label}: lightning is not installed: no Lightning rows")
        return rows
    finally:
        shutil.rmtree(directory, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)


def main(args: argparse.Namespace) -> int:
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("memckpt bench trainer needs transformers: pip install 'memckpt[hf]'", file=sys.stderr)
        return 2
    machine = machine_info()
    rows: list[dict[str, Any]] = []
    for label, size in args.sizes:
        try:
            rows += measure_size(label, size, args.steps, args.dir)
        except RuntimeError as e:
            print(f"memckpt bench trainer: {e}", file=sys.stderr)
            return 1
    ratios(rows)
    for r in rows:
        r["machine"] = machine
    write_rows(args.json, rows)
    print(report(rows, machine))
    return 0


def _cli(argv: Optional[list[str]] = None) -> int:
    return standalone("memckpt bench trainer", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    raise SystemExit(_cli())
