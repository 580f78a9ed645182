"""``memckpt report``: the timeline picture and its data, from a real run with a failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memckpt
from memckpt.cli import main
from memckpt.demo.job import GPTJob
from memckpt.cli.report import HEIGHT_PX, WIDTH_PX

JOB = GPTJob(steps=12, size="tiny", seed=3)
KILL_AT = 6


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the PNG's IHDR chunk."""
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR", f"{path} is no PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_missing_folder_exits_2_naming_it(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "no such folder" in err and "Traceback" not in err


def test_folder_without_events_exits_2_naming_events(tmp_path, capsys):
    (tmp_path / "losses.jsonl").write_text('{"step": 1, "loss": 2.0, "gen": 0}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert "no events.jsonl" in capsys.readouterr().err


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_report_of_a_run_with_a_worker_killed(cluster, tmp_path, capsys):
    config = memckpt.Config(
        job_name="report-kill",
        workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
        failure=memckpt.FailureConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0),
        chaos=(memckpt.ChaosEvent(step=KILL_AT, target="worker", rank=1),))
    run_dir = tmp_path / "run"
    result = memckpt.run(JOB, config, run_dir=run_dir, quiet=True)
    (rec,) = result["recoveries"]

    out, data = tmp_path / "t.png", tmp_path / "t.json"
    assert main(["report", str(run_dir), "--out", str(out), "--json", str(data)]) == 0
    assert png_size(out) == (WIDTH_PX, HEIGHT_PX)
    timeline = json.loads(data.read_text())

    events = lines(run_dir / "events.jsonl")
    (failure,) = [e for e in events if e["event"] == "failure_detected"]
    (plan,) = [e for e in events if e["event"] == "recovery_plan"]
    (drawn_failure,) = timeline["failures"]
    assert drawn_failure["time"] == failure["time"]
    assert drawn_failure["step"] == failure["reached_step"] >= KILL_AT - 1
    (drawn_rec,) = timeline["recoveries"]
    assert drawn_rec["time"] == plan["time"]
    assert drawn_rec["resumed_step"] == plan["resumed_step"] == rec["resumed_step"] == KILL_AT - 1
    assert drawn_rec["phases_s"]["total"] > 0  # from the recovery_finished event
    (rollback,) = timeline["rollbacks"]
    assert (rollback["from_step"], rollback["to_step"]) == (plan["resumed_step"] + 1,
                                                            failure["reached_step"])

    steps = timeline["steps"]
    assert [s["step"] for s in steps] == list(range(1, JOB.steps + 1))
    assert [s["loss"] for s in steps] == result["losses"]
    assert all(len(s["stall_ms"]) == 3 and s["stall_ms_max"] == max(s["stall_ms"]) > 0
               for s in steps)

    # the defaults: next to the run's files
    assert main(["report", str(run_dir)]) == 0
    assert png_size(run_dir / "timeline.png") == (WIDTH_PX, HEIGHT_PX)
    assert json.loads((run_dir / "timeline.json").read_text())["rollbacks"] == [rollback]
    assert "1 failure(s)" in capsys.readouterr().out


def test_world_size_over_the_steps_of_an_elastic_run(tmp_path):
    """A resized run's events give the world size from each step on, and the picture."""
    from memckpt.cli.report import draw, load_timeline
    lines = [{"time": 1.0, "event": "job_started", "world_size": 3},
             {"time": 5.0, "event": "failure_detected", "what": "node lost", "gen": 0},
             {"time": 6.0, "event": "resized", "from_world_size": 3, "to_world_size": 2,
              "step": 4, "why": "node lost", "gen": 1, "sources": {}},
             {"time": 9.0, "event": "resized", "from_world_size": 2, "to_world_size": 3,
              "step": 8, "why": "nodes with room appeared", "gen": 2, "sources": {}}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "losses.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 11)))
    t = load_timeline(tmp_path)
    assert [(w["from_step"], w["world_size"]) for w in t["world_sizes"]] == \
        [(1, 3), (5, 2), (9, 3)]
    assert [r["resumed_step"] for r in t["recoveries"]] == [4, 8]
    draw(t, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0
