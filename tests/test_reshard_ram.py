"""Resharding from RAM: replica stores holding a committed step of a 3-rank FSDP2 job
serve a 2-rank restore byte range by byte range over their TCP data plane; each new
rank fetches only what overlaps its chunks, and the state gathered to full is the
saved one bit for bit."""

from __future__ import annotations

import math

import pytest
import torch

from memckpt.runtime.node.replica_store import ReplicaStore
from _procs import spawn
from _reshard_job import merged, ram_restore_job, reported_loss, write_job

STEPS, MORE = 4, 6


@pytest.fixture
def wide(monkeypatch):
    # shards of ~6 MiB: many 256 KiB checksum chunks each, so ranges are partial
    monkeypatch.setenv("MEMCKPT_TEST_HIDDEN", "1024")


def test_fsdp_3_to_2_from_replica_stores(tmp_path, wide):
    stores = [ReplicaStore(str(tmp_path / "ram"), "reshard-ram", node) for node in ("a", "b")]
    try:
        addresses = [s.address("127.0.0.1") for s in stores]
        holders = {r: [addresses[r % 2], addresses[(r + 1) % 2]] for r in range(3)}  # 2 copies
        out = tmp_path / "out"
        out.mkdir()
        spawn(write_job, 3, "fsdp", str(tmp_path / "unused"), str(tmp_path / "ram-w"), str(out),
              STEPS, holders)
        assert all(sorted(s.inventory()) == [0, 1, 2] for s in stores)
        total = sum(len(stores[0].serve_bytes(r, STEPS)) for r in range(3))
        assert total > 3 * 2**20, total  # the ranks saw the test's MEMCKPT_TEST_HIDDEN
        # the first holder of rank 0 is gone: its reads go to the second copy
        holders[0] = [("127.0.0.1", 1)] + holders[0]
        spawn(ram_restore_job, 2, "fsdp", holders, 3, STEPS, str(out), MORE)
        before, after = merged(out, "before", 3), merged(out, "after", 2)
        assert sorted(before) == sorted(after)
        for k in before:
            assert torch.equal(before[k], after[k]), k
        for rank in range(2):
            got = torch.load(out / f"after-{rank}.pt", weights_only=False)
            assert got["step"] == STEPS
            assert got["report"] == {"loss": reported_loss(0)}  # old rank 0's, from RAM
            # half of the state plus checksum-chunk rounding and headers, never all of it
            assert got["bytes_read"] < 0.7 * total, (got["bytes_read"], total)
        losses = torch.load(out / "losses-0.pt")
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    finally:
        for s in stores:
            s.clear()
