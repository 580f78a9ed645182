"""A tier holding only another model's checkpoints: the job stops naming the newest
checkpoint and the first mismatching tensor, and nothing is written; with
``LoadSpec(on_incompatible="start_fresh")`` it starts at 0 beside them and never
touches them (not even retention or a step number they share)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

import memckpt
from memckpt.errors import ConfigError, IncompatibleCheckpointError


def tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def job(tmp_path: Path, hidden: int, steps: range, name: str, **load) -> tuple[int, list[dict]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = memckpt.TrainState(model=model, optimizer=opt)
    cfg = memckpt.Config(job_name="incompat", ram_root=str(tmp_path / f"ram-{name}"),
                         persistence=[memckpt.PersistTier(str(tmp_path / "ckpt"), keep_last=1)],
                         snapshot_every=2, load=memckpt.LoadSpec(**load))
    ckpt = memckpt.Checkpointer(cfg)
    try:
        start = ckpt.restore(state)
        for step in steps:
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            ckpt.step(state, step)
            if step % 2 == 0:
                ckpt.persist_now(step)
    finally:
        ckpt.close(unlink=True)
    return start, ckpt.events


def test_another_models_checkpoint_stops_the_job(tmp_path):
    job(tmp_path, 16, range(1, 5), "a")
    before = tree(tmp_path / "ckpt")
    assert any("step-0000000004" in k for k in before)
    with pytest.raises(IncompatibleCheckpointError) as err:
        job(tmp_path, 32, range(1, 3), "b")
    msg = str(err.value)
    assert "checkpoint step 4" in msg and "tensor 'model/model/0.weight'" in msg
    assert "[16, 8]" in msg and "[32, 8]" in msg and "start_fresh" in msg
    assert tree(tmp_path / "ckpt") == before  # nothing written, nothing removed


def test_start_fresh_leaves_old_checkpoints_untouched(tmp_path):
    job(tmp_path, 16, range(1, 5), "a")
    before = tree(tmp_path / "ckpt")
    start, events = job(tmp_path, 32, range(1, 7), "b", on_incompatible="start_fresh")
    assert start == 0
    (ev,) = [e for e in events if e["event"] == "incompatible_checkpoint"]
    assert ev["step"] == 4 and "model/model/0.weight" in ev["reason"]
    after = tree(tmp_path / "ckpt")
    assert {k: after[k] for k in before} == before  # old checkpoints kept byte for byte
    # step 4 is the old model's: refused; step 6 is new, persisted beside it
    assert [e["step"] for e in events if e["event"] == "persist_refused"] == [4]
    assert any(k.startswith("step-0000000006/") for k in after)
    # and the next start resumes the new model from its own step 6
    start, _ = job(tmp_path, 32, range(7, 8), "c", on_incompatible="start_fresh")
    assert start == 6


def test_a_restart_after_start_fresh_resumes_the_new_model_below_the_old_step(tmp_path):
    """The new model's newest checkpoint is older than the old model's: a restart passes
    the old ones over again and resumes the new model's own (not step 0 a second time)."""
    job(tmp_path, 16, range(1, 9), "a")  # the old model up to step 8
    before = tree(tmp_path / "ckpt")
    start, _ = job(tmp_path, 32, range(1, 5), "b", on_incompatible="start_fresh")
    assert start == 0
    start, events = job(tmp_path, 32, range(5, 7), "c", on_incompatible="start_fresh")
    assert start == 4  # the new model's step 4, below the old model's 8
    assert [e["step"] for e in events if e["event"] == "incompatible_checkpoint"] == [8]
    after = tree(tmp_path / "ckpt")
    assert {k: after[k] for k in before} == before  # still byte for byte
    assert any(k.startswith("step-0000000006/") for k in after)
    # without start_fresh the old model's newest checkpoint still stops the job
    with pytest.raises(IncompatibleCheckpointError, match="checkpoint step 8"):
        job(tmp_path, 32, range(7, 8), "d")


def test_on_incompatible_is_validated():
    with pytest.raises(ConfigError, match="on_incompatible"):
        memckpt.LoadSpec(on_incompatible="ignore")
