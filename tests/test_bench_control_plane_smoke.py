"""``memckpt bench control-plane`` at tiny sizes (no Ray): rows, report, JSON and plot.

Only that the rows are complete and consistent: no speed or ratio is asserted (the
machine running the tests is shared)."""

from __future__ import annotations

import json

import pytest

from memckpt.bench.control_plane import transport
from memckpt.bench.control_plane.command import _cli, plot, report
from memckpt.bench.control_plane.measure import measure
from memckpt.config import ControlConfig


@pytest.fixture(scope="module")
def row():
    # 1 s steps (a store skips a heartbeat when a batch went within the interval, so
    # steps faster than the interval would leave no heartbeat at all), 1.5 s timeout
    return measure(32, per_node=8, steps=2, frozen=True, timeout_s=1.5)


def test_every_step_commits_through_the_uplinks_and_the_pipe(row):
    assert row["ranks"] == 32 and row["nodes"] == 4 and row["per_node"] == 8
    assert row["steps"] == 2
    calls = row["calls_by_method"]
    # every node's batch each step (an answer came back for each, or the step raised)
    assert calls["node_ready"] == 4
    assert calls["node_heartbeat"] > 0  # the Uplinks' own heartbeat threads
    assert calls["progress"] > 0 and calls["pending_faults"] > 0  # the driver's polls
    assert row["messages_per_step"] == pytest.approx(sum(calls.values()))
    assert row["node_messages_per_step"] == pytest.approx(
        sum(v for k, v in calls.items() if k.startswith("node_")))
    assert set(row["bytes_by_method"]) == set(calls)
    assert row["bytes_per_step"] == pytest.approx(sum(row["bytes_by_method"].values()))
    assert not row["errors"], row["last_error"]
    assert row["state_writes_per_step"] == 0 and row["state_bytes_per_step"] == 0
    assert row["start_state_writes"] == 2  # configure, then the registrations once
    assert 0 < row["inside_per_step_s"] <= row["cpu_per_step_s"]
    assert 0 < row["serial_per_step_s"] <= row["cpu_per_step_s"]
    assert 0 < row["commit_at_coordinator_s"] and 0 < row["commit_latency_s"]
    assert row["commit_latency_s"] <= row["commit_latency_p99_s"] <= row["commit_latency_max_s"]
    assert row["node_cpu_per_step_s"] > 0 and row["wall_per_step_s"] > 0
    # real time: its last heartbeat -> named, past the timeout
    assert row["frozen_node_detect_s"] > row["heartbeat_timeout_s"]
    assert row["plan_after_node_loss_s"] is not None
    assert "CPU/step" in report([row])


def test_relays_merge_each_groups_batches_and_a_frozen_leader_is_named():
    """8 nodes in 2 relay groups of 4: one message a group a step instead of one a node;
    the frozen node (the first: a group's leader) is named alone, as without relays."""
    row = measure(32, per_node=4, steps=2, frozen=True, timeout_s=1.5, plan=False,
                  control=ControlConfig(relay_fanout=4, relay_min_nodes=2))
    calls = row["calls_by_method"]
    assert row["nodes"] == 8 and row["relay_groups"] == 2
    assert "node_ready" not in calls and calls["group_ready"] >= 2, calls
    assert not row["errors"], row["last_error"]
    assert row["frozen_node_detect_s"] > row["heartbeat_timeout_s"]


def test_transport_answers_in_order_and_times_out(tmp_path):
    link = transport.start(4, str(tmp_path))
    try:
        c = link.handle
        refs = [c.committed.remote() for _ in range(20)]
        assert [link.get(r, 30) for r in refs] == [None] * 20
        assert all(r.sent_at <= r.taken_at <= r.answered_at <= r.got_at for r in refs)
        held = c.wait_commit.remote(-1, 5, 1.0)  # nothing commits: held, then answered
        with pytest.raises(TimeoutError):
            link.get(held, 0.05)
        assert link.get(held, 30)[0] is None
        with pytest.raises(RuntimeError, match="no_such_method"):
            link.get(c.no_such_method.remote(), 30)
        stats = link.stats()
        assert stats["calls"]["committed"] == 20 and stats["bytes_in"]["committed"] > 0
    finally:
        link.close()


def test_command_writes_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "cp.png"
    assert _cli(["--ranks", "16", "--per-node", "4", "--steps", "1", "--step-s", "0.25",
                 "--no-frozen",
                 "--json", str(out), "--plot", str(png)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["ranks"], r["per_node"]) for r in rows] == [(16, 4)]
    assert rows[0]["frozen_node_detect_s"] is None
    assert png.stat().st_size > 0
    assert "CPU/step" in capsys.readouterr().out
    # the sweep's shapes, drawn against ranks and nodes (a second version dashed)
    shaped = [dict(rows[0], ranks=n * k, nodes=n, per_node=k, cpu_per_step_s=1e-3 * n)
              for n, k in ((4, 4), (4, 8), (8, 4))]
    against = plot(shaped, str(tmp_path / "vs.png"), before=rows)
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
