"""Smoke test of ``memckpt bench fsdp-stall``: two FSDP2 ranks over gloo, a tiny state, the rows."""

from __future__ import annotations

import json

import pytest

from memckpt import cli


@pytest.mark.timeout(180)
def test_fsdp_stall_bench_measures_every_rank(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = cli.main(["bench", "fsdp-stall", "--size", "4M", "--ranks", "2", "--repeats", "2",
                   "--layers", "4", "--json", str(out), "--ram-root", str(tmp_path / "ram")])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        # every layer's weight, bias and their two AdamW moments are DTensors, sharded:
        # each rank holds about half of the ~4 MiB state
        assert r["dtensors"] == 4 * 2 * 3
        assert 0.4 * 4 * 2**20 < r["local_bytes"] < 0.6 * 4 * 2**20, r
        assert r["memcpy_s"] > 0 and r["memckpt_s"] > 0 and r["gather_s"] > 0
        assert len(r["memckpt_times_s"]) == 2 and r["allocations_flat"] is True
    printed = capsys.readouterr().out
    assert "| rank | local bytes | memcpy | memckpt stall | × memcpy | × memcpy (best" in printed
    assert "FSDP2 over 2 ranks (gloo, CPU mesh)" in printed and "targets:" in printed
    assert not list((tmp_path / "ram").iterdir()), "slots must be freed after the run"


def test_cuda_without_enough_gpus_is_a_usage_error(capsys):
    import torch
    if torch.cuda.device_count() >= 64:
        pytest.skip("a machine with 64 GPUs")
    assert cli.main(["bench", "fsdp-stall", "--device", "cuda", "--ranks", "64"]) == 2
    assert "lower --ranks" in capsys.readouterr().err
