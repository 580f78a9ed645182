"""Checkpointer: exact resume across processes, RAM vs file restore, overlap mode.

The exact-resume tests run real Python processes (tests/_resume_job.py): one
trains and snapshots into a shared-memory ``ram_root`` and ends (or is
SIGKILLed), a fresh one restores from that RAM and continues. Losses must match
an uninterrupted run float-for-float and the final parameters bit-for-bit.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import selectors
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import memckpt
from memckpt.format import shard as fmt
from memckpt.errors import ChecksumError, StateError

HELPER = Path(__file__).with_name("_resume_job.py")
REPO = HELPER.parent.parent

# case id -> (scenario, k = last step of the first process, N = last step overall)
CASES = {
    "sgd_momentum": ("sgd", 6, 15),
    "adamw_scheduler": ("adamw", 2, 12),  # resumes before the warmup->cosine milestone at 3
    "shuffled_dataloader": ("data", 5, 16),  # 7 batches/epoch: crosses epochs at 7 and 14
    "dataloader_at_epoch_end": ("data", 7, 16),  # stops exactly on the last batch of epoch 0
    "dropout_numpy_python_rng": ("rng", 4, 12),
    "overlap_mode": ("overlap", 5, 12),
}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _helper(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(HELPER), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env(), **kw)


def _printed_losses(stdout: str) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for line in stdout.splitlines():
        job, word, s, loss = line.split()
        assert word == "step", line
        out.setdefault(job, {})[int(s)] = float(loss)
    return out


def _assert_same_tree(a, b, path="") -> None:
    """Recursive bit-exact equality of nested dicts/lists of tensors and scalars."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensors differ at {path}"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same_tree(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _load_result(out: Path) -> tuple[dict, dict, dict]:
    result = json.loads((out / "result.json").read_text())
    resumed = torch.load(out / "resumed.pt", weights_only=True)
    reference = torch.load(out / "reference.pt", weights_only=True)
    return result, resumed, reference


def _assert_exact_resume(result: dict, resumed: dict, reference: dict, first_losses: dict) -> None:
    restored, upto = result["restored"], result["upto"]
    ref = {int(s): v for s, v in result["reference"].items()}
    got = {int(s): v for s, v in result["resumed"].items()}
    assert sorted(ref) == list(range(1, upto + 1))
    assert sorted(got) == list(range(restored + 1, upto + 1)) and got, "nothing was resumed"
    # The interrupted process followed the reference up to where it stopped ...
    for s, loss in first_losses.items():
        assert loss == ref[s], f"first process diverged at step {s}: {loss!r} != {ref[s]!r}"
    # ... and the fresh process continued it exactly.
    for s in got:
        assert got[s] == ref[s], f"step {s}: resumed loss {got[s]!r} != uninterrupted {ref[s]!r}"
    _assert_same_tree(resumed["model"], reference["model"], "model")
    _assert_same_tree(resumed["optim"], reference["optim"], "optim")


@pytest.fixture(scope="module")
def resume_runs():
    """Every exact-resume case: one process trains to k and ends, a fresh one resumes."""
    root = tempfile.mkdtemp(prefix="memckpt-test-resume-",
                            dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    outs = Path(tempfile.mkdtemp(prefix="memckpt-test-resume-out-"))
    try:
        args = []
        for case, (sc, k, n) in CASES.items():
            args += ["--case", f"{case}:{sc}:{k}"]
        p = _helper("first", "--ram-root", root, *args)
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, f"first process failed:\n{stderr}"
        printed = _printed_losses(stdout)
        args = []
        for case, (sc, k, n) in CASES.items():
            args += ["--case", f"{case}:{sc}:{n}"]
        r = _helper("resume", "--ram-root", root, "--out", str(outs), *args)
        _, stderr = r.communicate(timeout=240)
        assert r.returncode == 0, f"resume process failed:\n{stderr}"
        yield {case: (printed.get(case, {}),) + _load_result(outs / case) for case in CASES}
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(outs, ignore_errors=True)


@pytest.mark.parametrize("case", list(CASES))
def test_exact_resume_in_fresh_process(resume_runs, case):
    scenario, k, n = CASES[case]
    first_losses, result, resumed, reference = resume_runs[case]
    assert sorted(first_losses) == list(range(1, k + 1))
    assert result["restored"] == k and result["upto"] == n
    _assert_exact_resume(result, resumed, reference, first_losses)
    if scenario == "data":
        got = {int(s): v for s, v in result["resumed_seen"].items()}
        ref = {int(s): v for s, v in result["reference_seen"].items()}
        assert got == {s: ref[s] for s in range(k + 1, n + 1)}, "data order differs after resume"
        epoch0 = [i for s in range(1, 8) for i in ref[s]]
        epoch1 = [i for s in range(8, 15) for i in ref[s]]
        assert sorted(epoch0) == sorted(epoch1) == list(range(26))
        assert epoch0 != epoch1 and epoch0 != list(range(26)), "sampler did not shuffle per epoch"


def test_resume_after_sigkill_mid_run(ram_root, tmp_path):
    """SIGKILL a training process (sync mode and overlap mode) after it printed step k."""
    k = 5
    jobs = {"killed-sync": "rng", "killed-overlap": "overlap"}
    procs = {job: _helper("first", "--ram-root", ram_root, "--case", f"{job}:{sc}:100000")
             for job, sc in jobs.items()}
    printed: dict[str, dict[int, float]] = {job: {} for job in jobs}
    live = {p.stdout: job for job, p in procs.items()}
    try:
        with selectors.DefaultSelector() as sel:
            for f in live:
                sel.register(f, selectors.EVENT_READ)
            while live:  # read both as they train; kill each right after its step k line
                events = sel.select(timeout=60)
                assert events, f"no output from {sorted(live.values())} for 60 s"
                for key, _ in events:
                    job = live[key.fileobj]
                    line = key.fileobj.readline()
                    if line:
                        _, _, s, loss = line.split()
                        printed[job][int(s)] = float(loss)
                    if not line or int(s) == k:
                        os.kill(procs[job].pid, signal.SIGKILL)  # mid-run: 99995 steps to go
                        sel.unregister(key.fileobj)
                        del live[key.fileobj]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()  # no-op if already killed; never leave a helper running
            p.wait(timeout=30)
    for job, p in procs.items():
        assert p.returncode == -signal.SIGKILL, p.stderr.read()
        assert k in printed[job]
        p.stdout.close()
        p.stderr.close()

    r = _helper("resume", "--ram-root", ram_root, "--extra", "8", "--out", str(tmp_path),
                *[a for job, sc in jobs.items() for a in ("--case", f"{job}:{sc}:0")])
    _, stderr = r.communicate(timeout=120)
    assert r.returncode == 0, stderr
    for job in jobs:
        result, resumed, reference = _load_result(tmp_path / job)
        # Step k's snapshot was taken before "step k" was printed, and the wait policy
        # sealed step k-1 before k was written; the kill may land a step or two later.
        assert result["restored"] >= k - 1, job
        assert result["upto"] == result["restored"] + 8
        _assert_exact_resume(result, resumed, reference, printed[job])


# ---- in-process tests --------------------------------------------------------------------

class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.b = nn.Linear(16, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.b(torch.relu(self.a(x)))


def _make_state(seed: int = 0):
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    sampler = memckpt.ResumableSampler(10, shuffle=True, seed=3)
    return memckpt.TrainState(model=model, optimizer=opt, scheduler=sched, data=sampler,
                              extras={"tokens": 0})


def _train(state, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    state.optimizer.zero_grad()
    loss = F.mse_loss(state.model(x), y) + 0.01 * torch.rand(())
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    it = iter(state.data)
    next(it)
    state.extras["tokens"] += 5
    return loss.item()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def _captured(state) -> tuple[dict[str, torch.Tensor], dict]:
    cap = state.capture(0)
    return {n: t.clone() for n, t in cap.tensors}, cap.meta


def _rng_now():
    return torch.get_rng_state(), np.random.get_state(), random.getstate()


def _assert_rng_equal(a, b) -> None:
    assert torch.equal(a[0], b[0])
    assert a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:]
    assert a[2] == b[2]


def test_restore_from_ram_and_from_saved_file_are_bitwise_identical(ram_root, tmp_path):
    cfg = memckpt.Config(ram_root=ram_root)
    state = _make_state()
    ckpt = memckpt.Checkpointer(cfg)
    for step in range(1, 5):
        _train(state, step)
        assert ckpt.step(state, step)
    np.random.rand(3)  # make numpy/python RNG state non-trivial before the snapshot
    random.random()
    _train(state, 5)
    ckpt.step(state, 5)
    want_tensors, want_meta = _captured(state)
    want_rng = _rng_now()
    path = tmp_path / "step5.shard"
    assert ckpt.save(path) == 5
    with ckpt.engine.reading(5) as shard:
        assert path.read_bytes() == shard.raw.tobytes()

    from_ram, from_file = _make_state(seed=1), _make_state(seed=2)
    torch.rand(10), np.random.rand(5), random.random()  # disturb every RNG stream
    assert ckpt.restore(from_ram) == 5
    rng_ram = _rng_now()
    torch.rand(10), np.random.rand(5), random.random()
    assert ckpt.restore(from_file, source=path) == 5
    rng_file = _rng_now()

    for restored, rng in ((from_ram, rng_ram), (from_file, rng_file)):
        got_tensors, got_meta = _captured(restored)
        assert list(got_tensors) == list(want_tensors)
        for name in want_tensors:
            assert torch.equal(_bits(got_tensors[name]), _bits(want_tensors[name])), name
        assert {k: v for k, v in got_meta.items() if k != "rng"} == \
            {k: v for k, v in want_meta.items() if k != "rng"}
        _assert_rng_equal(rng, want_rng)
        assert restored.extras == {"tokens": 25}
        assert restored.data.state_dict() == state.data.state_dict()
        assert restored.scheduler.state_dict() == state.scheduler.state_dict()
    # and all three continue the same way from the same RNG state
    losses = []
    for s in (state, from_ram, from_file):
        torch.set_rng_state(want_rng[0]), np.random.set_state(want_rng[1]), random.setstate(want_rng[2])
        losses.append(_train(s, 6))
    assert losses[0] == losses[1] == losses[2]
    for a, b, c in zip(state.model.parameters(), from_ram.model.parameters(),
                       from_file.model.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    ckpt.close(unlink=True)


def test_overlap_snapshot_holds_parameters_as_of_snapshot_time(ram_root):
    torch.manual_seed(0)
    # ~32 MB of parameters and as much Adam state: the background copy takes a while
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    state = memckpt.TrainState(model=model, optimizer=opt, rng=False)
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, snapshot_mode="overlap"))
    x = torch.randn(4, 1024)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    copy_done_at_update = []
    step()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_opt = {n: {k: v.clone() for k, v in opt.state[p].items()}
                    for n, p in model.named_parameters()}
    assert ckpt.step(state, 1)
    # registered after memckpt's own pre-hook, so it runs after that one
    opt.register_step_pre_hook(lambda *_: copy_done_at_update.append(ckpt.engine._copy_done.landed()))
    step()  # its optimizer.step mutates every parameter right away
    assert copy_done_at_update == [True]
    ckpt.wait()
    with ckpt.engine.reading(1) as shard:
        for k, v in expected.items():
            got = shard.tensors[f"model/model/{k}"]
            assert torch.equal(got, v), f"{k} in the step-1 snapshot is not the step-1 value"
            assert not torch.equal(got, model.state_dict()[k]), "the step did not change params"
        for pname, st in expected_opt.items():
            for k, v in st.items():
                assert torch.equal(shard.tensors[f"optim/optimizer/model/{pname}/{k}"], v)
    ckpt.close(unlink=True)


def test_restore_falls_back_to_older_snapshot_when_newest_is_corrupt(ram_root):
    cfg = memckpt.Config(ram_root=ram_root)
    state = _make_state()
    ckpt = memckpt.Checkpointer(cfg)
    params = {}
    for step in (1, 2):
        _train(state, step)
        ckpt.step(state, step)
        params[step] = [p.detach().clone() for p in state.model.parameters()]
    ckpt.wait()
    newest = next(s for s in ckpt.engine.slots if s.step == 2)
    path = newest.path
    ckpt.close()
    with open(path, "r+b") as f:  # flip one byte of the data region
        f.seek(fmt.data_offset(newest.header_capacity) + 17)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))

    again = memckpt.Checkpointer(cfg)  # a new process would see the same files
    fresh = _make_state(seed=9)
    assert again.restore(fresh) == 1
    assert all(torch.equal(a, b) for a, b in zip(fresh.model.parameters(), params[1]))
    skipped = [e for e in again.events if e["event"] == "snapshot_skipped"]
    assert [e["step"] for e in skipped] == [2] and str(path) in skipped[0]["reason"]
    again.close()


def test_restore_refuses_when_every_ram_snapshot_is_corrupt(ram_root):
    cfg = memckpt.Config(ram_root=ram_root)
    state = _make_state()
    ckpt = memckpt.Checkpointer(cfg)
    for step in (1, 2):
        _train(state, step)
        ckpt.step(state, step)
    ckpt.wait()
    slots = [(s.path, s.header_capacity) for s in ckpt.engine.slots]
    ckpt.close()
    for path, cap in slots:
        with open(path, "r+b") as f:
            f.seek(fmt.data_offset(cap) + 3)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 1]))
    again = memckpt.Checkpointer(cfg)
    with pytest.raises(ChecksumError) as ei:
        again.restore(_make_state(seed=3))
    assert "every snapshot in RAM is corrupt" in str(ei.value)
    for path, _ in slots:
        assert str(path) in str(ei.value)
    again.close()


def test_fresh_start_restores_nothing_and_leaves_state_alone(ram_root):
    state = _make_state()
    before = [p.detach().clone() for p in state.model.parameters()]
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    assert ckpt.restore(state) == 0
    assert all(torch.equal(a, b) for a, b in zip(before, state.model.parameters()))
    ckpt.close(unlink=True)


def test_snapshot_every_n_steps(ram_root):
    state = _make_state()
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, snapshot_every=3))
    taken = []
    for step in range(1, 8):
        _train(state, step)
        taken.append(ckpt.step(state, step))
    ckpt.wait()
    assert taken == [False, False, True, False, False, True, False]
    assert ckpt.engine.steps() == [6, 3]
    ckpt.close(unlink=True)


def test_shard_of_another_rank_is_refused(ram_root, tmp_path):
    cfg = memckpt.Config(ram_root=ram_root)
    state = _make_state()
    ckpt = memckpt.Checkpointer(cfg, rank=1, world_size=2)
    _train(state, 1)
    ckpt.step(state, 1)
    ckpt.save(tmp_path / "r1.shard")
    other = memckpt.Checkpointer(cfg, rank=0, world_size=2)
    with pytest.raises(StateError, match="rank 1 of 2"):
        other.restore(_make_state(seed=4), source=tmp_path / "r1.shard")
    ckpt.close(unlink=True)
    other.close(unlink=True)


def test_close_removes_the_overlap_hook_from_the_optimizer(ram_root):
    """A closed Checkpointer must not keep gating (or be kept alive by) the optimizer."""
    import memckpt
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = memckpt.Checkpointer(memckpt.Config(job_name="hooks", ram_root=ram_root,
                                               snapshot_mode="overlap"))
    ckpt.step(memckpt.TrainState(model, opt), 1)
    assert len(opt._optimizer_step_pre_hooks) == 1
    ckpt.close(unlink=True)
    assert len(opt._optimizer_step_pre_hooks) == 0
    opt.step()  # no hook left to call into the closed engine


def test_every_ranks_restore_and_step_implements_one_interface():
    """The five "one rank's restore and step" classes share one Protocol, and Checkpointer
    takes no flag that only a subclass would set (each says what is its own)."""
    import inspect

    from memckpt.checkpointer import RestoreAndStep
    from memckpt.integrations.saver import Saver
    from memckpt.ray_train.context import RayTrainContext
    from memckpt.runtime.worker.context import WorkerContext
    from memckpt.runtime.worker.rank_checkpointer import RankCheckpointer
    for cls in (memckpt.Checkpointer, RankCheckpointer, WorkerContext, RayTrainContext, Saver):
        assert RestoreAndStep in cls.__mro__, cls
    assert not {"gated", "persist", "prefill"} & set(inspect.signature(memckpt.Checkpointer).parameters)


def test_snapshot_every_is_read_in_one_place():
    import ast
    package = Path(memckpt.__file__).parent
    readers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py")
                     for node in ast.walk(ast.parse(p.read_text()))
                     if isinstance(node, ast.Attribute) and node.attr == "snapshot_every"
                     and isinstance(node.ctx, ast.Load) and p.name != "config.py")
    assert readers == ["checkpointer.py"], readers
