"""The README's run command, small: the multi-node demo in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.timeout(900)]


@pytest.mark.parametrize("fault", ["worker", "cluster"])
def test_demo_recovers_bit_identically(fault, tmp_path):
    summary = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "memckpt.cli", "demo", "--fault", fault, "--tiny",
                          "--steps", "12", "--summary", str(summary)],
                         capture_output=True, text=True, timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "losses identical: yes; final digest identical: yes" in res.stdout
    s = json.loads(summary.read_text())
    assert s["identical"] is True and s["final_digest"] == s["reference_digest"]
    if fault == "worker":
        assert len(s["recoveries"]) == 1 and s["recoveries"][0]["died_ranks"] == [1]
    else:  # resumed on a new cluster from the persisted tier
        assert s["first_step"] > 1, res.stdout[-4000:] + res.stderr[-2000:]


def test_fsdp_demo_recovers_bit_identically(tmp_path):
    summary = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "memckpt.cli", "demo", "--model", "fsdp",
                          "--fault", "worker", "--tiny", "--steps", "8", "--summary",
                          str(summary)], capture_output=True, text=True, timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "with FSDP2" in res.stdout
    assert "losses identical: yes; final digest identical: yes" in res.stdout
    s = json.loads(summary.read_text())
    assert s["identical"] is True and len(s["recoveries"]) == 1
    assert len(set(s["rank_digests"])) == 3  # sharded: every rank holds other chunks
