"""The CUDA paths: a SIGKILLed CUDA process restores bit-identically onto the GPU (sync and
overlap), and a corrupted chunk is refused on the GPU restore path. Skipped without CUDA."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import memckpt
from memckpt.format import shard as fmt

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

JOB = Path(__file__).with_name("_gpu_job.py")
KILL_AT, UPTO = 6, 10


def _run(*args: str, kill_after: int | None = None) -> None:
    # the job imports memckpt from this checkout also where it is not installed
    root = str(Path(__file__).resolve().parents[1])
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8",
               PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    p = subprocess.Popen([sys.executable, str(JOB), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    if kill_after is None:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        return
    for line in p.stdout:
        if line.strip() == f"step {kill_after}":
            p.send_signal(signal.SIGKILL)
            break
    p.wait(timeout=60)
    assert p.returncode == -signal.SIGKILL, p.stderr.read()


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_sigkilled_cuda_process_restores_bit_identically(mode, tmp_path):
    root = tempfile.mkdtemp(prefix="memckpt-gpu-", dir="/dev/shm")
    try:
        _run("train", "--ram-root", root, "--job", "killed", "--mode", mode,
             "--upto", str(UPTO + 100), kill_after=KILL_AT)
        _run("resume", "--ram-root", root, "--job", "killed", "--mode", mode,
             "--upto", str(UPTO), "--out", str(tmp_path / "resumed.pt"))
        _run("train", "--ram-root", root, "--job", "reference", "--mode", mode,
             "--upto", str(UPTO), "--out", str(tmp_path / "reference.pt"))
    finally:
        subprocess.run(["rm", "-rf", root])
    got = torch.load(tmp_path / "resumed.pt", weights_only=True)
    ref = torch.load(tmp_path / "reference.pt", weights_only=True)
    assert got["restored"] == KILL_AT
    assert got["devices"] == ["cuda"]  # parameters and the restored moments on the GPU
    for k, v in ref["model"].items():
        assert torch.equal(got["model"][k], v), k
    for i, st in ref["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optim"]["state"][i][k], v), (i, k)


@pytest.mark.parametrize("where", ["tmpfs", "disk"])  # pinned slots; unpinned ones
def test_corrupt_chunk_is_refused_on_the_cuda_restore(where, tmp_path):
    root = tempfile.mkdtemp(prefix="memckpt-gpu-", dir="/dev/shm") if where == "tmpfs" \
        else str(tmp_path)
    cfg = memckpt.Config(ram_root=root)
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.AdamW(model.parameters())
    state = memckpt.TrainState(model=model, optimizer=opt)
    ckpt = memckpt.Checkpointer(cfg)
    kept = {}
    for step in (1, 2):
        model(torch.randn(4, 512, device="cuda")).sum().backward()
        opt.step()
        ckpt.step(state, step)
        ckpt.wait()
        kept[step] = model.weight.detach().clone()
    newest = next(s for s in ckpt.engine.slots if s.step == 2)
    ckpt.close()
    with open(newest.path, "r+b") as f:  # flip a byte in the last chunk (optimizer state)
        at = fmt.data_offset(newest.header_capacity) + newest.layout.data_len - 100
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 1]))
    model2 = torch.nn.Linear(512, 512).cuda()
    opt2 = torch.optim.AdamW(model2.parameters())
    again = memckpt.Checkpointer(cfg)
    assert again.restore(memckpt.TrainState(model=model2, optimizer=opt2)) == 1
    assert model2.weight.is_cuda and torch.equal(model2.weight, kept[1])
    assert opt2.state[model2.weight]["exp_avg"].is_cuda
    assert [e["step"] for e in again.events if e["event"] == "snapshot_skipped"] == [2]
    again.close(unlink=True)
    subprocess.run(["rm", "-rf", root])


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_the_seal_behind_the_device_copy_seals_the_final_bytes(mode, tmp_path):
    """The seal hashes each chunk once the side stream's copy wrote it (CUDA events): a
    chunk hashed too early would not verify. The copy is made slow to land (a busy
    compute stream it waits for), so the seal starts well before the bytes are in."""
    from memckpt.engine.snapshot import SnapshotEngine
    from memckpt.format.state import Captured
    tensors = [(f"model/w{i}", torch.randn(8 << 20, device="cuda")) for i in range(8)]  # 256 MiB
    captured = Captured(tensors=tensors, meta={}, stable=frozenset(
        n for n, _ in tensors) if mode == "overlap" else frozenset())
    engine = SnapshotEngine(tmp_path, mode=mode, seal_threads=8)
    try:
        for step in (1, 2, 3):
            busy = torch.randn(4096, 4096, device="cuda")
            for _ in range(20):  # queued ahead of the copy, which waits for the compute stream
                busy = busy @ busy / 4096
            for _, t in tensors:
                t.add_(1.0)
            assert engine.snapshot(captured, step)
            engine.wait_copy()
            engine.wait()
            with engine.reading(step) as shard:  # verifies every chunk
                for name, t in tensors:
                    assert torch.equal(shard.tensors[name], t.cpu()), (step, name)
    finally:
        engine.close(unlink=True)
