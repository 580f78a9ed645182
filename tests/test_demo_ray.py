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


def test_drill_kill_is_not_reported_as_a_crash(tmp_path):
    """Ray's "A worker died or was killed ... OOM killer ..." notice for the worker the drill
    killed is replaced by one line saying it was the drill."""
    res = subprocess.run([sys.executable, "-m", "memckpt.cli", "demo", "--fault", "worker",
                          "--tiny", "--steps", "6", "--no-compare"],
                         capture_output=True, text=True, timeout=840, cwd=tmp_path)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "A worker died or was killed" not in out and "OOM killer" not in out, out[-4000:]
    drill = [line for line in res.stdout.splitlines() if "not a crash" in line]
    assert drill == ["[memckpt demo] a worker process was killed: the drill's fault "
                     "(--fault worker), not a crash"], out[-4000:]


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


def test_elastic_demo_shrinks_and_grows_back(tmp_path):
    """``memckpt demo --fault node --elastic``: 3 -> 2 ranks from RAM, a node added, back
    to 3; the timeline picture is drawn in the run folder (under the working directory)."""
    summary = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "memckpt.cli", "demo", "--fault", "node",
                          "--elastic", "--tiny", "--steps", "40", "--kill-at", "5",
                          "--summary", str(summary)],
                         capture_output=True, text=True, timeout=840, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert [r["resized"] for r in s["recoveries"]] == [{"from": 3, "to": 2},
                                                       {"from": 2, "to": 3}]
    assert s["world_size"] == 3 and len(s["losses"]) == 40
    assert "resized from 3 to 2 ranks" in res.stdout
    assert (tmp_path / "runs" / "demo-elastic" / "timeline.png").stat().st_size > 0
