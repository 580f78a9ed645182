"""Real snapshot shards for the store and transport tests: a Checkpointer snapshots a
small model + AdamW into RAM, and the tests stream those bytes the way replication does."""

from __future__ import annotations

import shutil
import tempfile

import numpy as np
import pytest
import torch

import memckpt
from conftest import shm_base


def _train_state(seed: int = 0) -> memckpt.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return memckpt.TrainState(model=model, optimizer=opt)


def _train_step(state: memckpt.TrainState, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    (opt,) = state.optimizers.values()
    opt.zero_grad()
    torch.nn.functional.mse_loss(state.model(x), y).backward()
    opt.step()


def _snapshot(ckpt: memckpt.Checkpointer, state, step: int) -> tuple[np.ndarray, str]:
    _train_step(state, step)
    assert ckpt.step(state, step)
    ckpt.wait()
    with ckpt.engine.reading(step) as shard:
        return shard.raw.copy(), shard.header["data_xxh3"]


@pytest.fixture(scope="module")
def shards():
    """step -> (bytes, data checksum) of rank 0's real snapshots of steps 1..3."""
    root = tempfile.mkdtemp(prefix="memckpt-test-src-", dir=shm_base())
    try:
        ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=root, job_name="src"))
        state = _train_state()
        out = {s: _snapshot(ckpt, state, s) for s in (1, 2, 3)}
        ckpt.close(unlink=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert len({d for _, d in out.values()}) == 3  # training changed the state every step
    return out
