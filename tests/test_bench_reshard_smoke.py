"""``memckpt bench reshard`` runs end to end at a tiny size (4 FSDP2 writers, 2 and 3
readers, from disk, RAM and dcp.load) and reports what it measured."""

from __future__ import annotations

from memckpt.bench.reshard.measure import run_reshard_bench


def test_reshard_bench_rows(tmp_path):
    rows = run_reshard_bench(2 << 20, worlds=(3,), directory=str(tmp_path))
    assert [(r["source"], r["to_ranks"]) for r in rows] == [("ram", 3), ("disk", 3), ("dcp", 3)]
    for r in rows:
        assert r["seconds"] > 0 and r["peak_rss"] > 0 and r["new_shard_bytes"] > 0
    ram, disk, _ = rows
    assert ram["bytes_read"] == disk["bytes_read"] > 0  # the same ranges from either source
