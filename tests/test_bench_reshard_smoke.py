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


def _aborting_rank(rank: int, world: int, port: int, work: str) -> None:
    """Rank 1 aborts as a C++ terminate does (SIGABRT, no Python error); rank 0 ends as the
    bench's ranks end (no group here: it leaves without the interpreter's teardown)."""
    import os
    from pathlib import Path

    from memckpt.bench.common import end_rank_process
    Path(work, f"r-{rank}.pt").write_bytes(b"x")
    if rank == 1:
        os.abort()
    end_rank_process()


def _raising_rank(rank: int, world: int, port: int, work: str) -> None:
    from pathlib import Path
    Path(work, f"error-r{rank}.txt").write_text(f"ValueError: rank {rank} could not read\n")
    raise ValueError(f"rank {rank} could not read")


def test_a_failed_rank_is_named_with_its_error_and_what_the_ranks_left(tmp_path):
    """A rank that aborts or raises fails the bench with the phase, each rank's own error
    (or that none wrote one: a signal) and the files the ranks left, not torch's bare
    "process 1 terminated with signal SIGABRT"."""
    import pytest

    from memckpt.bench.reshard.measure import _spawn
    aborted, raised = tmp_path / "a", tmp_path / "r"
    aborted.mkdir()
    raised.mkdir()
    with pytest.raises(RuntimeError) as e:
        _spawn(_aborting_rank, 2, str(aborted), str(aborted))
    text = str(e.value)
    assert text.startswith("aborting_rank ranks (world 2): process 1 terminated with signal SIGABRT")
    assert "no rank wrote an error (a signal or an abort)" in text
    assert "'r-1.pt'" in text
    with pytest.raises(RuntimeError) as e:
        _spawn(_raising_rank, 1, str(raised), str(raised))
    assert "--- error-r0.txt\nValueError: rank 0 could not read" in str(e.value)
