"""Smoke test of ``memckpt bench ray-train`` at a tiny size: every part runs, the rows are
JSON with positive figures, memckpt's restore came from RAM and the report names the
phases, so the benchmark never rots."""

from __future__ import annotations

import json

import pytest

from memckpt import cli


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_ray_train_bench_at_a_tiny_size(tmp_path, capsys, full_cluster):
    """On the session's cluster (connected: the benchmark starts none of its own)."""
    out = tmp_path / "rows.json"
    rc = cli.main(["bench", "ray-train", "--sizes", "2M", "--steps", "2", "--warmup", "1",
                   "--compute-n", "64", "--kill-at", "3", "--dir", str(tmp_path / "work"),
                   "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    kinds = {(r["benchmark"], r["method"]) for r in rows}
    assert kinds == {("stall", "memckpt"), ("stall", "ray-train-report"),
                     ("recovery", "memckpt"), ("recovery", "ray-train-restore"),
                     ("lost_work", "memckpt"), ("lost_work", "ray-train-report")}
    for r in rows:
        assert r["median"] > 0 and r["state_bytes"] > 0, r
    rec = next(r for r in rows if r["benchmark"] == "recovery" and r["method"] == "memckpt")
    assert set(rec["phases_s"]) >= {"restart", "restore", "first_step", "total"}
    assert all(s.startswith(("local:", "peer:")) for s in rec["sources"]), rec["sources"]
    # Ray Train's own restart from its storage_path (the raytrain_recovery that bench
    # compare's ray-train-restore row measures too): every phase timed
    alt = next(r for r in rows if r["benchmark"] == "recovery"
               and r["method"] == "ray-train-restore")
    assert set(alt["phases_s"]) >= {"restore", "total"}
    assert all(v > 0 for v in alt["phases_s"].values()), alt["phases_s"]
    text = capsys.readouterr().out
    assert "recovery" in text and "restart" in text
