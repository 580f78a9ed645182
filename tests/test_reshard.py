"""Universal restore: a checkpoint persisted by N ranks in one layout loads into M ranks
in another (real processes over gloo), and every parameter and optimizer tensor,
gathered to full, equals the one gathered before the save, bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from _procs import spawn
from _reshard_job import commit, merged, reported_loss, restore_job, write_job

STEPS, MORE = 4, 6


def run_reshard(tmp_path: Path, root: str, src: tuple[str, int], dst: tuple[str, int]) -> dict:
    out = tmp_path / "out"
    out.mkdir()
    (src_layout, n), (dst_layout, m) = src, dst
    spawn(write_job, n, src_layout, root, str(tmp_path / "ram-a"), str(out), STEPS)
    commit(root, STEPS, n)
    spawn(restore_job, m, dst_layout, root, str(tmp_path / "ram-b"), str(out), MORE, {})
    before, after = merged(out, "before", n), merged(out, "after", m)
    assert sorted(before) == sorted(after)
    for k in before:
        assert torch.equal(before[k], after[k]), f"{k} differs after resharding {src} -> {dst}"
    first = torch.load(out / "after-0.pt", weights_only=False)
    assert first["step"] == STEPS
    if n != m:
        (ev,) = [e for e in first["events"] if e["event"] == "resharded"]
        assert (ev["from_world_size"], ev["to_world_size"]) == (n, m)
    losses = torch.load(out / "losses-0.pt")
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    # the step's loss comes back with it: a resharded resume gives every rank what old
    # rank 0 reported (the loss a job's curve shows), a same-layout one each rank its own
    for rank in range(m):
        got = torch.load(out / f"after-{rank}.pt", weights_only=False)["report"]
        assert got == {"loss": reported_loss(rank if src == dst else 0)}, rank
    return {"before": before, "events": first["events"]}


@pytest.mark.parametrize("src,dst", [(("ddp", 3), ("ddp", 2)), (("zero", 3), ("zero", 2)),
                                     (("zero", 2), ("ddp", 3))])
def test_reshard_plain_from_disk(tmp_path, src, dst):
    run_reshard(tmp_path, str(tmp_path / "ckpt"), src, dst)


@pytest.mark.parametrize("src,dst", [(("fsdp", 4), ("fsdp", 2)), (("fsdp", 2), ("fsdp", 3)),
                                     (("fsdp", 3), ("single", 1)), (("tp", 2), ("single", 1)),
                                     (("fsdp", 2), ("tp", 2))])
def test_reshard_dtensor_from_disk(tmp_path, src, dst):
    run_reshard(tmp_path, str(tmp_path / "ckpt"), src, dst)
