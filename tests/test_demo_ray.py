"""The README's run command, small: the multi-node demo in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_report import assert_readable

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.timeout(900)]


def assert_reads_as_a_story(stdout: str) -> list[str]:
    """The demo's output: under 60 lines; first what will happen and about how long; then
    placement, progress, the fault, the plan, the recovery, the comparison; last the
    recovery's phases beside the model's step time. No progress line repeats itself."""
    print(stdout)  # shown with pytest -rP: the output a user reads
    out = stdout.splitlines()
    assert len(out) < 60, stdout
    assert out[0].startswith("memckpt demo (about ") and " min on 2 cores)" in out[0], out[0]
    progress = [line for line in out if " steps/s committed " in line]
    assert progress and all(a != b for a, b in zip(progress, progress[1:])), progress

    def first(text: str) -> int:
        return next(i for i, line in enumerate(out) if text in line)
    order = [first("replica placement"), first("steps/s committed"), first("failure detected"),
             first("recovery plan"), first("identical: yes"), first("recovery from")]
    assert order == sorted(order), stdout
    assert out[-1].startswith("for scale: one training step of this model takes "), stdout
    assert out[-2].startswith("recovery from "), stdout
    return out


def test_readme_demo_command(tmp_path):
    """``memckpt demo --fault worker`` exactly as the README has it (the default model and
    steps): a worker SIGKILLed, recovered, bit-identical to an uninterrupted run; a story
    of under 60 lines, which calls the drill's kill the drill's, not a crash."""
    summary = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "memckpt.cli", "demo", "--fault", "worker",
                          "--summary", str(summary)],
                         capture_output=True, text=True, timeout=840, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "losses identical: yes; final digest identical: yes" in res.stdout
    out = assert_reads_as_a_story(res.stdout)
    assert "GPT 'tiny'" in out[0] and "for 20 steps" in out[0] and "after step 10" in out[0]
    s = json.loads(summary.read_text())
    assert s["identical"] is True and s["final_digest"] == s["reference_digest"]
    assert len(s["recoveries"]) == 1 and s["recoveries"][0]["died_ranks"] == [1]
    assert len(s["losses"]) == 20 and 0 < s["step_s"] < 10
    # Ray's "A worker died or was killed ... OOM killer ..." notice for the worker the drill
    # killed is replaced by one line saying it was the drill
    both = res.stdout + res.stderr
    assert "A worker died or was killed" not in both and "OOM killer" not in both, both[-4000:]
    drill = [line for line in out if "not a crash" in line]
    assert drill == ["[memckpt demo] a worker process was killed: the drill's fault "
                     "(--fault worker), not a crash"], both[-4000:]


def test_demo_resumes_a_lost_cluster_from_the_persisted_tier(tmp_path):
    summary = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "memckpt.cli", "demo", "--fault", "cluster",
                          "--tiny", "--steps", "12", "--summary", str(summary)],
                         capture_output=True, text=True, timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "losses identical: yes; final digest identical: yes" in res.stdout
    s = json.loads(summary.read_text())
    assert s["identical"] is True and s["final_digest"] == s["reference_digest"]
    # resumed on a new cluster from the persisted tier
    assert s["first_step"] > 1, res.stdout[-4000:] + res.stderr[-2000:]


def test_fsdp_demo_recovers_bit_identically(tmp_path):
    summary = tmp_path / "summary.json"
    res = subprocess.run([sys.executable, "-m", "memckpt.cli", "demo", "--model", "fsdp",
                          "--fault", "worker", "--tiny", "--steps", "8", "--summary",
                          str(summary)], capture_output=True, text=True, timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "with FSDP2" in res.stdout or "FSDP2 (every block" in res.stdout
    assert "losses identical: yes; final digest identical: yes" in res.stdout
    assert_reads_as_a_story(res.stdout)
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
    out = res.stdout.splitlines()
    assert len(out) < 60 and out[0].startswith("memckpt demo (about "), res.stdout
    # the node's loss is a failure; growing back is planned, and never called one (Ray's
    # own "(raylet)" retry notices are Ray's, not the story's)
    assert [line for line in out if "fail" in line.lower() and "(raylet)" not in line] == \
        [next(line for line in out if "failure detected" in line)], res.stdout
    assert any("resizing as planned: nodes with room appeared" in line for line in out)
    assert out[-3].startswith("planned resize from 2 to 3 ranks after step "), res.stdout
    assert out[-2].startswith("for scale: one training step"), res.stdout
    run_dir = tmp_path / "runs" / "demo-elastic"
    events = [json.loads(line)["event"] for line in
              (run_dir / "events.jsonl").read_text().splitlines()]
    assert events.count("failure_detected") == 1 and events.count("resize_started") == 1
    from memckpt.cli.report import draw, load_timeline
    timeline = load_timeline(run_dir)
    assert len(timeline["failures"]) == 1
    assert [r["planned"] for r in timeline["recoveries"]] == [False, True]
    assert_readable(draw(timeline, tmp_path / "timeline.png"))
    assert (run_dir / "timeline.png").stat().st_size > 0
