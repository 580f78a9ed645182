"""``memckpt report``: the timeline picture and its data, from a real run with a failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import memckpt
from memckpt.cli import main
from memckpt.demo.job import GPTJob
from memckpt.cli.report import HEIGHT_PX, WIDTH_PX

KEEP_WORKERS = True  # the module's jobs hand their workers on (conftest.cluster)

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
        failure=memckpt.FailureConfig(warm_spares=False, heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0),
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
    # the steps redone: after the resumed one, up to the newest the coordinator had heard
    # of when it saw the failure. Rank 1 died on entering ctx.step(KILL_AT); the others'
    # word of step KILL_AT (a heartbeat, their summary) may or may not have come first.
    reached = failure["reached_step"]
    assert reached in (KILL_AT - 1, KILL_AT)
    redone = [(plan["resumed_step"] + 1, reached)] if reached > plan["resumed_step"] else []
    assert [(r["from_step"], r["to_step"]) for r in timeline["rollbacks"]] == redone

    steps = timeline["steps"]
    assert [s["step"] for s in steps] == list(range(1, JOB.steps + 1))
    assert [s["loss"] for s in steps] == result["losses"]
    # min / median / max over the ranks (steps.jsonl since #40)
    assert all(s["stall_of"] == "stats" and len(s["stall_ms"]) == 3
               and s["stall_ms_max"] == max(s["stall_ms"]) == s["stall_ms"][2] > 0 for s in steps)

    # the defaults: next to the run's files
    assert main(["report", str(run_dir)]) == 0
    assert png_size(run_dir / "timeline.png") == (WIDTH_PX, HEIGHT_PX)
    assert json.loads((run_dir / "timeline.json").read_text())["rollbacks"] == \
        timeline["rollbacks"]
    assert "1 failure(s)" in capsys.readouterr().out


def drawn_texts(fig) -> list:
    """Every text the figure shows (titles, axis labels, the tick labels inside the axes'
    limits, annotations, legends) with its extent in pixels."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    shown = list(fig.texts)
    for ax in fig.axes:
        shown += [ax.title, ax._left_title, ax._right_title, ax.xaxis.label, ax.yaxis.label]
        shown += list(ax.texts)
        if ax.get_legend():
            shown += list(ax.get_legend().get_texts())
        for lim, labels, i in ((ax.get_xlim(), ax.get_xticklabels(), 0),
                               (ax.get_ylim(), ax.get_yticklabels(), 1)):
            lo, hi = sorted(lim)
            shown += [t for t in labels if lo <= t.get_position()[i] <= hi]
    return [(t.get_text(), t.get_window_extent(renderer)) for t in shown
            if t.get_visible() and t.get_text().strip()]


def assert_readable(fig) -> None:
    """No two texts overlap (labels, ticks, titles, legends), and all lie in the figure."""
    texts = drawn_texts(fig)
    for text, box in texts:
        assert 0 <= box.x0 and box.x1 <= WIDTH_PX and 0 <= box.y0 and box.y1 <= HEIGHT_PX, \
            f"{text!r} leaves the {WIDTH_PX}x{HEIGHT_PX} figure: {box}"
    for i, (a, abox) in enumerate(texts):
        for b, bbox in texts[i + 1:]:
            assert not abox.overlaps(bbox), f"{a!r} overlaps {b!r}"


def test_world_size_over_the_steps_of_an_elastic_run(tmp_path, capsys):
    """A resized run's events give the world size from each step on; the picture tells the
    node's loss as a failure and the growth back as a planned resize, not a failure, with
    no label over another, everything inside the figure, and whole ranks on the size axis."""
    from memckpt.cli.report import draw, load_timeline
    lines = [{"time": 1.0, "event": "job_started", "world_size": 3},
             {"time": 5.0, "event": "failure_detected", "what": "node lost", "gen": 0,
              "reached_step": 5},
             {"time": 6.0, "event": "resized", "from_world_size": 3, "to_world_size": 2,
              "step": 4, "why": "node lost", "gen": 1, "sources": {}},
             {"time": 8.5, "event": "resize_started",
              "what": "nodes with room appeared: growing to 3 ranks", "gen": 1},
             {"time": 9.0, "event": "resized", "from_world_size": 2, "to_world_size": 3,
              "step": 8, "why": "nodes with room appeared", "gen": 2, "sources": {}},
             {"time": 9.5, "event": "recovery_finished", "gen": 2, "phases_s": {"total": 2.5}}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    (tmp_path / "losses.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 11)))
    t = load_timeline(tmp_path)
    assert [(w["from_step"], w["world_size"]) for w in t["world_sizes"]] == \
        [(1, 3), (5, 2), (9, 3)]
    assert [(r["resumed_step"], r["planned"]) for r in t["recoveries"]] == [(4, False),
                                                                          (8, True)]
    assert [f["what"] for f in t["failures"]] == ["node lost"]
    assert [(r["from_step"], r["to_step"]) for r in t["rollbacks"]] == [(5, 5)]
    fig = draw(t, tmp_path / "t.png")
    assert png_size(tmp_path / "t.png") == (WIDTH_PX, HEIGHT_PX)
    texts = [text for text, _ in drawn_texts(fig)]
    assert any("1 failure(s), 1 recovery(ies), 1 planned resize(s)" in x for x in texts), texts
    assert "grown to 3 ranks after step 8, back in 2.5 s" in texts
    assert sum("node lost" in x for x in texts) == 1  # the growth is no failure label
    size_axis = [ax for ax in fig.axes if ax.get_ylabel() == "world size (ranks)"]
    assert size_axis, "no world size axis"
    ticks = [x for x in size_axis[0].get_yticks() if 0 <= x <= 4]
    assert ticks and all(float(x).is_integer() for x in ticks), ticks
    assert_readable(fig)
    assert main(["report", str(tmp_path)]) == 0
    assert "1 failure(s), 1 recovery(ies), 1 planned resize(s)" in capsys.readouterr().out


def test_labels_of_many_incidents_do_not_overlap(tmp_path):
    """Failures close together (a rank dying twice in a few steps): each label has its
    own row, whatever the steps."""
    from memckpt.cli.report import draw, load_timeline
    events = [{"time": 1.0, "event": "job_started", "world_size": 3}]
    for k, step in enumerate((6, 7, 8, 20)):
        events += [{"time": 10.0 + k, "event": "failure_detected", "gen": k,
                    "what": f"rank {k % 3}'s worker died", "reached_step": step},
                   {"time": 10.5 + k, "event": "recovery_plan", "gen": k,
                    "resumed_step": step - 1, "sources": {}}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in events))
    (tmp_path / "losses.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 5.0 / s}) + "\n" for s in range(1, 25)))
    fig = draw(load_timeline(tmp_path), tmp_path / "t.png")
    assert_readable(fig)


def test_steps_of_either_format_give_the_stall_panel(tmp_path):
    """steps.jsonl from before #40 (every rank's stall) and after (min / median / max over
    the ranks) both load and draw."""
    from memckpt.cli.report import draw, load_timeline
    (tmp_path / "events.jsonl").write_text(json.dumps({"time": 1.0, "event": "job_started"})
                                           + "\n")
    rows = [{"step": 1, "gen": 0, "time": 2.0, "stall_s": [0.001, 0.003]},
            {"step": 2, "gen": 0, "time": 3.0, "ranks": 4,
             "stall_s": {"min": 0.001, "median": 0.002, "max": 0.004}}]
    (tmp_path / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = load_timeline(tmp_path)
    assert [s["stall_ms"] for s in t["steps"]] == [[1.0, 3.0], [1.0, 2.0, 4.0]]
    assert [s["stall_ms_max"] for s in t["steps"]] == [3.0, 4.0]
    draw(t, tmp_path / "t.png")
    assert png_size(tmp_path / "t.png") == (WIDTH_PX, HEIGHT_PX)
