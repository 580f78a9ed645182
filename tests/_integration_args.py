"""The command line both integration helper processes take (tests/_hf_job.py,
tests/_lightning_job.py): where the RAM snapshots go, the job, the output folder,
gradient accumulation, the step to SIGKILL the process at, the snapshot interval and mode."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Callable

import memckpt


def parse() -> tuple[argparse.Namespace, Path, memckpt.Config]:
    p = argparse.ArgumentParser()
    p.add_argument("--ram-root", required=True)
    p.add_argument("--job", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--mode", choices=memckpt.config.SNAPSHOT_MODES, default="sync")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    return a, out, memckpt.Config(job_name=a.job, ram_root=a.ram_root, snapshot_every=a.every,
                                  snapshot_mode=a.mode)


def kill_self_at(step: int, global_step: int, landed: Callable[[], None]) -> None:
    """SIGKILL this process once optimizer step ``step`` has ended (as a crash would), after
    ``landed()`` (the Checkpointer's ``wait``) returned: a snapshot still sealing when the
    process dies is lost and the resume goes back one further, so a drill that names the
    step it resumes from lets the last one land first (it does within a millisecond, but
    the training threads may hold both cores)."""
    if global_step == step:
        landed()
        os.kill(os.getpid(), signal.SIGKILL)
