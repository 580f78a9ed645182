"""``memckpt status``'s human view, from a coordinator status as the CLI receives it."""

from __future__ import annotations

from memckpt.cli.status import format_status

STATUS = {
    "gen": 1, "committed": 7, "restarts_of_coordinator": 0,
    "assignment": {"0": "nodeA" + "a" * 20, "1": "nodeB" + "b" * 20},
    "holders": {"0": ["standbyS" + "s" * 20], "1": ["standbyS" + "s" * 20]},
    "metrics": {"0": {"step": 8, "stall_s": 0.0123, "time": 99.0},
                "1": {"step": 8, "stall_s": 0.0101, "time": 100.0}},
}


def test_status_shows_placement_progress_and_the_standby_holder():
    text = format_status("gpt", STATUS, now=100.0)
    lines = text.splitlines()
    assert lines[0] == "job gpt: generation 1, committed step 7, coordinator restarts 0"
    assert "  rank 0: nodeAaaaaaaa -> standbySssss" in lines
    assert ("holding replicas, running no rank (take over a dead node's ranks): standbySssss"
            in lines)
    assert "  rank 0: step 8, snapshot stall 12.3 ms, last report 1.0s ago" in lines


def test_no_standby_line_when_every_holder_runs_ranks():
    ring = dict(STATUS, holders={"0": [STATUS["assignment"]["1"]], "1": [STATUS["assignment"]["0"]]})
    assert "running no rank" not in format_status("gpt", ring, now=100.0)
