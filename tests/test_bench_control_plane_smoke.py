"""``memckpt bench control-plane`` at tiny sizes (no Ray): rows, report, JSON and plot."""

from __future__ import annotations

import json

from memckpt.bench.control_plane.command import _cli
from memckpt.bench.control_plane.measure import measure


def test_rows_count_messages_and_no_state_write_per_step():
    row = measure(32, per_node=8, steps=2)
    assert row["ranks"] == 32 and row["nodes"] == 4
    assert row["messages_per_step"] == 2 * 4  # per node: its batch and one heartbeat
    assert row["bytes_per_step"] > 0
    assert row["state_writes_per_step"] == 0 and row["state_bytes_per_step"] == 0
    assert row["start_state_writes"] == 2  # configure, then the registrations once
    assert row["cpu_per_step_s"] > 0 and row["commit_latency_s"] > 0
    assert row["commit_latency_p99_s"] >= row["commit_latency_s"]
    # the simulated clock moves a heartbeat interval at a time: timeout + at most one
    assert row["heartbeat_timeout_s"] < row["frozen_node_detect_s"] \
        <= row["heartbeat_timeout_s"] + row["heartbeat_interval_s"]
    assert row["plan_after_node_loss_s"] is not None


def test_command_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "cp.png"
    assert _cli(["--ranks", "16,32", "--steps", "1", "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert [r["ranks"] for r in rows] == [16, 32]
    assert png.stat().st_size > 0
    assert "CPU/step" in capsys.readouterr().out
    against = tmp_path / "vs.png"
    assert _cli(["--ranks", "16", "--steps", "1", "--plot", str(against),
                 "--plot-against", str(out)]) == 0
    assert against.stat().st_size > 0


def test_plan_only_prints_each_decision_per_size(capsys):
    assert _cli(["--ranks", "64,128", "--plan-only"]) == 0
    out = capsys.readouterr().out.splitlines()
    head = next(i for i, x in enumerate(out) if x.split()[:1] == ["ranks"])
    assert out[head].split() == ["ranks", "placement", "decide", "inventory", "choose_nodes",
                                 "repair_holders", "plan_recovery", "total"]
    rows = [x.split() for x in out[head + 1:]]
    assert [r[0] for r in rows] == ["64", "128"]
    assert all(float(v) >= 0 for r in rows for v in r[1:])
