"""Exact resume of the two-rank demo job (DDP over gloo, optionally ZeRO), without Ray.

Each scenario starts a fresh pair of processes (``_procs.spawn``: forked from a server that
imported torch; world size 2, gloo on a free local port) running ``memckpt.demo.job.GPTJob``:

* reference: 12 uninterrupted steps, no checkpointing at all;
* interrupted: the same job snapshotting every step into a per-test shared-memory
  ``ram_root``, stopped after step 5 either cleanly or by SIGKILL of every rank;
* resumed: fresh processes restore step 5 from that RAM and train to step 12.

Every resumed step's loss must equal the reference's float-for-float, and each
rank's final ``state_digest`` (parameters and its optimizer shard, bit-for-bit)
must equal the reference rank's. With ZeRO this catches hyperparameters captured
stale from the local shard optimizer (the run diverged from the 2nd resumed step).

Processes report through JSON files in ``tmp_path``; the worker lives in this
module so spawned children import it by name.
"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import pytest
import torch.multiprocessing as mp

import _procs

WORLD_SIZE = 2
STEPS = 12
STOP_AT = 5


def _job(zero: bool):
    from memckpt.demo.job import GPTJob

    return GPTJob(steps=STEPS, size="tiny", seed=1, zero=zero)


class _Stop(Exception):
    """Raised by the fake context to end the interrupted run; caught in the worker."""


class FakeContext:
    """A minimal stand-in for :class:`memckpt.runtime.worker.worker.WorkerContext`, backed by a Checkpointer.

    The job only uses ``rank``, ``world_size``, ``restore(state) -> int`` and
    ``step(state, step, **metrics)``. With ``ckpt`` None nothing is snapshotted (the
    reference run); otherwise every step is snapshotted and sealed (``wait``) before
    training continues. ``resume`` restores the newest RAM snapshot; ``stop_at`` ends the
    run after that step by raising :class:`_Stop`; ``kill_at`` SIGKILLs this process after
    that step's snapshot is sealed on every rank.
    """

    def __init__(self, rank: int, world_size: int, ckpt: Any = None, *, resume: bool = False,
                 stop_at: Optional[int] = None, kill_at: Optional[int] = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.ckpt, self.resume, self.stop_at, self.kill_at = ckpt, resume, stop_at, kill_at
        self.state = None
        self.restored = 0
        self.losses: dict[int, float] = {}

    def restore(self, state) -> int:
        self.state = state
        self.restored = self.ckpt.restore(state) if self.resume else 0
        return self.restored

    def step(self, state, step: int, **metrics: float) -> None:
        self.losses[step] = metrics["loss"]
        if self.ckpt is not None:
            self.ckpt.step(state, step)
            self.ckpt.wait()
        if step == self.kill_at:
            import torch.distributed as dist

            # Both ranks' step-5 snapshots are sealed before either dies: once one rank
            # exits, mp.spawn terminates the other, possibly mid-snapshot.
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.stop_at:
            raise _Stop


def _worker(rank: int, world_size: int, port: int, zero: bool, mode: str,
            ram_root: Optional[str], out: str) -> None:
    """One rank. mode: "reference", "stop", "kill" or "resume"."""
    import torch
    import torch.distributed as dist

    import memckpt
    from memckpt.format.digest import state_digest

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    # A bounded timeout: a rank restoring a different step than its peer fails, not hangs.
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    ckpt = None
    if mode != "reference":
        ckpt = memckpt.Checkpointer(memckpt.Config(job_name="dist-exact", ram_root=ram_root),
                                    rank, world_size)
    ctx = FakeContext(rank, world_size, ckpt, resume=mode == "resume",
                      stop_at=STOP_AT if mode == "stop" else None,
                      kill_at=STOP_AT if mode == "kill" else None)
    try:
        _job(zero)(ctx)
    except _Stop:
        pass
    result = {"restored": ctx.restored, "losses": sorted(ctx.losses.items()),
              "digest": state_digest(ctx.state)}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    if ckpt is not None:
        ckpt.close()
    # Both ranks tear gloo down together: a rank that closed its connections while the
    # other was still finishing once aborted that one ("terminate called without an active
    # exception", SIGABRT) in an uninterrupted reference run, under load.
    dist.barrier()
    dist.destroy_process_group()


def _spawn(zero: bool, mode: str, ram_root: Optional[str], out: Path) -> None:
    _procs.spawn(_worker, WORLD_SIZE, zero, mode, ram_root, str(out))


def _results(out: Path) -> list[dict]:
    results = []
    for rank in range(WORLD_SIZE):
        r = json.loads(Path(f"{out}.rank{rank}.json").read_text())
        r["losses"] = {int(s): loss for s, loss in r["losses"]}
        results.append(r)
    return results


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, one per ``zero`` value, computed once per module."""
    cache: dict[bool, list[dict]] = {}

    def get(zero: bool) -> list[dict]:
        if zero not in cache:
            out = tmp_path_factory.mktemp("reference") / f"zero{int(zero)}"
            _spawn(zero, "reference", None, out)
            cache[zero] = _results(out)
            for r in cache[zero]:
                assert sorted(r["losses"]) == list(range(1, STEPS + 1))
        return cache[zero]

    return get


def _assert_exact(ref: list[dict], first: Optional[list[dict]], resumed: list[dict]) -> None:
    for rank in range(WORLD_SIZE):
        want = ref[rank]["losses"]
        if first is not None:  # the interrupted run followed the reference up to its stop
            assert first[rank]["losses"] == {s: want[s] for s in range(1, STOP_AT + 1)}
        got = resumed[rank]
        assert got["restored"] == STOP_AT, f"rank {rank} restored step {got['restored']}"
        assert sorted(got["losses"]) == list(range(STOP_AT + 1, STEPS + 1))
        for s, loss in got["losses"].items():
            assert loss == want[s], (f"rank {rank} step {s}: resumed loss {loss!r} != "
                                     f"uninterrupted {want[s]!r}")
        assert got["digest"] == ref[rank]["digest"], f"rank {rank}: final state differs"


@pytest.mark.timeout(180)
@pytest.mark.parametrize("zero", [True, False], ids=["zero", "ddp"])
def test_resume_after_clean_stop_is_exact(reference, ram_root, tmp_path, zero):
    _spawn(zero, "stop", ram_root, tmp_path / "stop")
    _spawn(zero, "resume", ram_root, tmp_path / "resume")
    _assert_exact(reference(zero), _results(tmp_path / "stop"), _results(tmp_path / "resume"))


@pytest.mark.timeout(180)
def test_resume_after_sigkill_is_exact(reference, ram_root, tmp_path):
    with pytest.raises(mp.ProcessExitedException) as exc:
        _spawn(True, "kill", ram_root, tmp_path / "kill")
    assert exc.value.signal_name == "SIGKILL"
    assert not list(tmp_path.glob("kill.*")), "a killed rank got past step 5"
    _spawn(True, "resume", ram_root, tmp_path / "resume")
    _assert_exact(reference(True), None, _results(tmp_path / "resume"))
