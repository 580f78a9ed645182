"""The single-process demo: SIGKILL a training process, restore it from RAM, compare.

Three runs of the same training job (the demo GPT, AdamW with weight-decay
groups, warm-up + cosine LR, a shuffled :class:`memckpt.ResumableSampler`,
dropout), each in its own Python process with a :class:`memckpt.Checkpointer`
snapshotting every step into shared memory:

1. a **reference** run, never interrupted;
2. a **faulted** run, SIGKILLed by this process as soon as it reports step
   ``kill_at`` (the child reports a step once its snapshot is sealed in RAM, then
   waits for a go-ahead, so the kill always lands at the same place);
3. a **resumed** run: a fresh process, same ``ram_root``, that calls
   :meth:`memckpt.Checkpointer.restore` and trains to the end.

The faulted run's losses up to the restored step, followed by the resumed run's,
must equal the reference run's step for step, and the final parameters and
optimizer state must hash to the same digest.

Children speak one JSON object per line on stdout; ``python -m
memckpt.demo.single_process --child ...`` is the child side (internal).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

from memckpt.errors import MemckptError
from memckpt.util.fsutil import write_atomic

DEFAULT_STEPS = 20
DEFAULT_SIZE = "mini"
DEFAULT_BATCH = 8
CHILD_TIMEOUT_S = 900.0
JOB_NAME = "demo"


class DemoError(MemckptError):
    """A demo run did not behave (a child crashed, hung, or restored nothing)."""


# Measured on a 2-core machine: a child process's start (torch imported), a step per size.
CHILD_START_S = 8.0
STEP_S = {"tiny": 0.05, "mini": 0.6, "small": 2.0}


def estimate_s(steps: int, size: str) -> float:
    """About how long the local demo takes on 2 cores: three children, twice the steps."""
    return 3 * CHILD_START_S + 2 * steps * STEP_S.get(size, 1.0)


def default_kill_at(steps: int) -> int:
    """Roughly a third of the way in (step 7 of 20)."""
    return min(steps - 1, max(1, round(steps * 0.35)))


# ---- the training job (child side) -------------------------------------------------------

def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    """Linear warm-up for ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model, lr: float, weight_decay: float = 0.1):
    """AdamW; matrices decay, biases / LayerNorm / embeddings-as-vectors do not."""
    import torch
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def _emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def _child(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m memckpt.demo.single_process --child")
    p.add_argument("--child", action="store_true")
    p.add_argument("--size", default=DEFAULT_SIZE)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--ram-root", required=True)
    p.add_argument("--restore", action="store_true", help="restore from RAM first")
    p.add_argument("--lockstep", action="store_true",
                   help="after reporting each step, wait for a line on stdin")
    a = p.parse_args(argv)

    import torch
    from torch.utils.data import DataLoader

    import memckpt
    from memckpt.demo.model import PRESETS, build, state_digest

    cfg = PRESETS[a.size]
    model, data = build(cfg, a.seed)
    optimizer = make_optimizer(model, a.lr)
    warmup = max(1, a.steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, warmup, a.steps))
    sampler = memckpt.ResumableSampler(len(data), shuffle=True, seed=a.seed)
    # A private generator: creating a DataLoader iterator must not draw from the
    # global RNG (that stream drives dropout and is part of the snapshot).
    loader = DataLoader(data, batch_size=a.batch_size, sampler=sampler, num_workers=0,
                        drop_last=True, generator=torch.Generator())
    state = memckpt.TrainState(model=model, optimizer=optimizer, scheduler=scheduler,
                               data=sampler, extras={"tokens_seen": 0})
    config = memckpt.Config(job_name=JOB_NAME, snapshot_every=1, snapshot_mode="sync",
                            ram_root=a.ram_root)

    t0 = time.perf_counter()
    ckpt = memckpt.Checkpointer(config)
    start = 0
    if a.restore:
        start = ckpt.restore(state)
        seconds = time.perf_counter() - t0
        if start == 0:
            _emit(event="error", message=f"no snapshot in RAM under {ckpt.directory}")
            return 1
        _emit(event="restored", step=start, seconds=seconds, source="ram",
              directory=str(ckpt.directory), tokens_seen=state.extras["tokens_seen"])
    _emit(event="ready", pid=os.getpid(), parameters=model.num_parameters(), start=start,
          threads=torch.get_num_threads())

    def batches() -> Iterator:
        while True:  # epochs; the sampler knows which one and where in it
            yield from loader

    stream = batches()
    model.train()
    for step in range(start + 1, a.steps + 1):
        t_step = time.perf_counter()
        x, y = next(stream)
        _, loss = model(x, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        state.extras["tokens_seen"] += x.numel()
        t_snap = time.perf_counter()
        ckpt.step(state, step)
        ckpt.wait()  # report a step only once its snapshot is sealed in RAM
        now = time.perf_counter()
        _emit(event="step", step=step, loss=loss.item(), lr=scheduler.get_last_lr()[0],
              epoch=sampler.epoch, step_seconds=now - t_step, snapshot_seconds=now - t_snap)
        if a.lockstep and not sys.stdin.readline():
            return 0  # the parent is gone
    _emit(event="done", step=a.steps, digest=state_digest(model, optimizer),
          tokens_seen=state.extras["tokens_seen"])
    ckpt.close()
    return 0


# ---- driving the children (parent side) --------------------------------------------------

@dataclass
class _Run:
    """One child process and what it reported."""

    name: str
    proc: subprocess.Popen
    stderr_path: Path
    losses: dict[int, float] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    digest: Optional[str] = None
    restored: Optional[dict[str, Any]] = None
    started: float = field(default_factory=time.perf_counter)
    finished: Optional[float] = None

    def messages(self) -> Iterator[dict[str, Any]]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            self.events.append(msg)
            if msg.get("event") == "step":
                self.losses[int(msg["step"])] = float(msg["loss"])
            elif msg.get("event") == "done":
                self.digest = msg["digest"]
            elif msg.get("event") == "restored":
                self.restored = msg
            elif msg.get("event") == "error":
                raise DemoError(f"{self.name} run: {msg.get('message')}")
            yield msg

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])

    def finish(self, expect_ok: bool = True) -> int:
        rc = self.proc.wait()
        self.finished = time.perf_counter()
        for stream in (self.proc.stdout, self.proc.stdin):
            if stream is not None:
                stream.close()
        if expect_ok and rc != 0:
            tail = self.stderr_tail()
            raise DemoError(f"the {self.name} run exited with code {rc}"
                            + (f":\n{tail}" if tail else ""))
        return rc

    def median_step(self, key: str = "step_seconds") -> float:
        times = sorted(float(e[key]) for e in self.events if e.get("event") == "step")
        return times[len(times) // 2] if times else 0.0

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started


def _ram_base() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _spawn(name: str, child_args: list[str], logs: Path, lockstep: bool = False) -> _Run:
    import memckpt
    env = dict(os.environ)
    pkg_parent = str(Path(memckpt.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    stderr_path = logs / f"{name}.stderr"
    with open(stderr_path, "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "memckpt.demo.single_process", "--child", *child_args],
            stdin=subprocess.PIPE if lockstep else subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=err, env=env, text=True, bufsize=1)
    return _Run(name, proc, stderr_path)


def _watchdog(run: _Run, timeout: float) -> threading.Timer:
    def stop() -> None:
        if run.proc.poll() is None:
            run.proc.kill()

    timer = threading.Timer(timeout, stop)
    timer.daemon = True
    timer.start()
    return timer


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def run_local(steps: int = DEFAULT_STEPS, kill_at: Optional[int] = None,
              summary: Optional[str | os.PathLike] = None, tiny: bool = False,
              size: Optional[str] = None, seed: int = 0, batch_size: int = DEFAULT_BATCH,
              out: Optional[TextIO] = None) -> int:
    """Run the three-process demo; returns 0 only if the resumed run is bit-identical.

    ``size`` picks a model preset from :data:`memckpt.demo.model.PRESETS`
    (``tiny=True`` means ``"tiny"``; default ``"mini"``). ``summary`` also writes the
    result as JSON. Raises :class:`DemoError` if a run crashes or restores nothing.
    """
    from memckpt.demo.model import PRESETS, count_parameters

    stream = out or sys.stdout

    def say(line: str) -> None:
        stream.write(line + "\n")
        stream.flush()

    size = "tiny" if tiny else (size or DEFAULT_SIZE)
    if size not in PRESETS:
        raise DemoError(f"unknown model size {size!r}: choose one of {', '.join(PRESETS)}")
    if steps < 2:
        raise DemoError(f"steps={steps}: the demo needs at least 2 steps")
    kill_at = default_kill_at(steps) if kill_at is None else kill_at
    if not 1 <= kill_at <= steps - 1:
        raise DemoError(f"kill_at={kill_at} must be between 1 and steps-1={steps - 1}")
    cfg = PRESETS[size]
    params = count_parameters(cfg)
    common = ["--size", size, "--steps", str(steps), "--seed", str(seed),
              "--batch-size", str(batch_size)]
    t_start = time.perf_counter()
    minutes = max(0.5, round(estimate_s(steps, size) / 30) / 2)
    say(f"memckpt demo (local, about {minutes:g} min on 2 cores, no Ray): GPT '{size}' "
        f"{params / 1e6:.2f}M params, {steps} steps, AdamW + warm-up/cosine LR, shuffled "
        f"resumable sampler, dropout {cfg.dropout}, a snapshot to RAM every step; trained "
        f"once uninterrupted, then again with the process SIGKILLed after step {kill_at} and "
        "a new one restoring from RAM, and the two compared bit for bit")

    root = Path(tempfile.mkdtemp(prefix=f"memckpt-demo-{os.getpid()}-", dir=_ram_base()))
    logs = root / "logs"
    logs.mkdir()
    runs: list[_Run] = []
    try:
        # 1. reference: never interrupted
        ref = _spawn("reference", common + ["--ram-root", str(root / "reference")], logs)
        runs.append(ref)
        timer = _watchdog(ref, CHILD_TIMEOUT_S)
        for _ in ref.messages():
            pass
        ref.finish()
        timer.cancel()
        if ref.digest is None or len(ref.losses) != steps:
            raise DemoError(f"the reference run stopped after {len(ref.losses)} of {steps} steps")
        say(f"  reference run : {steps} steps without a fault, loss {ref.losses[1]:.3f} -> "
            f"{ref.losses[steps]:.3f}, {_ms(ref.median_step())} a step ({ref.seconds:.1f} s)")

        # 2. faulted: SIGKILL as soon as it reports step kill_at
        ram_root = str(root / "faulted")
        bad = _spawn("faulted", common + ["--ram-root", ram_root, "--lockstep"], logs,
                     lockstep=True)
        runs.append(bad)
        timer = _watchdog(bad, CHILD_TIMEOUT_S)
        killed_pid, t_kill = None, None
        assert bad.proc.stdin is not None
        for msg in bad.messages():
            if msg.get("event") != "step":
                continue
            if msg["step"] >= kill_at:
                killed_pid = bad.proc.pid
                os.kill(killed_pid, signal.SIGKILL)
                t_kill = time.perf_counter()
                break
            try:
                bad.proc.stdin.write("go\n")
                bad.proc.stdin.flush()
            except BrokenPipeError:
                break  # it died on its own: reported below
        rc = bad.finish(expect_ok=False)
        timer.cancel()
        if killed_pid is None:
            tail = bad.stderr_tail()
            raise DemoError(f"the faulted run exited with code {rc} before step {kill_at}"
                            + (f":\n{tail}" if tail else ""))
        say(f"  faulted run   : SIGKILL to pid {killed_pid} right after step {kill_at} "
            f"(exit code {rc})")

        # 3. resumed: a fresh process restores from the same RAM and runs to the end
        res = _spawn("resumed", common + ["--ram-root", ram_root, "--restore"], logs)
        runs.append(res)
        timer = _watchdog(res, CHILD_TIMEOUT_S)
        t_back = None
        for msg in res.messages():
            if msg.get("event") == "ready":
                t_back = time.perf_counter()
        res.finish()
        timer.cancel()
        if res.restored is None or res.digest is None:
            raise DemoError("the resumed run did not restore and finish")
        resumed_step = int(res.restored["step"])
        restore_s = float(res.restored["seconds"])
        downtime = (t_back - t_kill) if (t_back and t_kill) else None
        say(f"  resumed run   : new process restored step {resumed_step} from RAM in "
            f"{_ms(restore_s)}" + (f" (training again {downtime:.1f} s after the kill, "
                                   "most of it Python and torch start-up)" if downtime else "")
            + f", trained steps {resumed_step + 1}-{steps} ({res.seconds:.1f} s)")
    finally:
        for r in runs:
            if r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()
        shutil.rmtree(root, ignore_errors=True)

    stitched = [bad.losses[s] for s in range(1, resumed_step + 1)] + \
               [res.losses[s] for s in range(resumed_step + 1, steps + 1)]
    reference = [ref.losses[s] for s in range(1, steps + 1)]
    losses_ok = stitched == reference
    digest_ok = res.digest == ref.digest
    identical = losses_ok and digest_ok
    recovery = {
        "died": f"training process pid {killed_pid}",
        "signal": "SIGKILL",
        "killed_after_step": kill_at,
        "source": "ram",
        "resumed_step": resumed_step,
        "restore_seconds": restore_s,
        "downtime_seconds": downtime,
    }
    yes = {True: "yes", False: "NO"}
    say(f"killed at step {kill_at} (SIGKILL), restored step {resumed_step} from RAM in "
        f"{_ms(restore_s)}, {steps - resumed_step} more steps; losses identical: "
        f"{yes[losses_ok]}; final digest identical: {yes[digest_ok]}")
    if not losses_ok:
        first = next(i for i, (a, b) in enumerate(zip(stitched, reference)) if a != b)
        say(f"  first difference at step {first + 1}: {stitched[first]!r} vs {reference[first]!r}")
    total_s = time.perf_counter() - t_start
    if summary is not None:
        doc = {
            "identical": identical,
            "losses": stitched,
            "reference_losses": reference,
            "final_digest": res.digest,
            "reference_digest": ref.digest,
            "recoveries": [recovery],
            "steps": steps,
            "kill_at": kill_at,
            "model": {"size": size, "parameters": params, "config": cfg.to_dict()},
            "batch_size": batch_size,
            "seed": seed,
            "seconds": total_s,
            "median_step_seconds": ref.median_step(),
            "median_snapshot_seconds": ref.median_step("snapshot_seconds"),
        }
        path = Path(summary)
        write_atomic(path, (json.dumps(doc, indent=2) + "\n").encode())
        say(f"summary written to {path} ({total_s:.1f} s in all)")
    return 0 if identical else 1


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        sys.exit(_child(sys.argv[1:]))
    sys.exit(run_local())
