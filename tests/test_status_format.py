"""``memckpt status``'s human view, from a coordinator status as the CLI receives it."""

from __future__ import annotations

from memckpt.cli.status import format_ranks, format_status

STATUS = {
    "gen": 1, "committed": 7, "restarts_of_coordinator": 0,
    "assignment": {"0": "nodeA" + "a" * 20, "1": "nodeB" + "b" * 20},
    "holders": {"0": ["standbyS" + "s" * 20], "1": ["standbyS" + "s" * 20]},
    "units": {"nodeA" + "a" * 20: {"step": 8, "ranks": 8, "stall_max_s": 0.0123, "age_s": 1.0,
                                   "landed": 64.0, "requested": 64.0},
              "nodeB" + "b" * 20: {"step": 8, "ranks": 8, "stall_max_s": 0.0101, "age_s": 0.0,
                                   "landed": 60.0, "requested": 64.0},
              "rank 16": {"step": 7, "ranks": 1, "stall_max_s": 0.002, "age_s": 0.5}},
}


def test_status_shows_placement_progress_and_the_standby_holder():
    text = format_status("gpt", STATUS, now=100.0)
    lines = text.splitlines()
    assert lines[0] == "job gpt: generation 1, committed step 7, coordinator restarts 0"
    assert "  rank 0: nodeAaaaaaaa -> standbySssss" in lines
    assert ("holding replicas, running no rank (take over a dead node's ranks): standbySssss"
            in lines)
    assert "  node nodeAaaaaaaa (8 ranks): step 8, snapshot stall max 12.3 ms, last report " \
        "1.0s ago" in lines
    # a node whose ranks did not land every due snapshot says so
    assert "  node nodeBbbbbbbb (8 ranks): step 8, snapshot stall max 10.1 ms, snapshots " \
        "landed 60 of 64, last report 0.0s ago" in lines
    # a rank with no store on its node reports alone
    assert "  rank 16 (1 rank): step 7, snapshot stall max 2.0 ms, last report 0.5s ago" in lines


def test_late_ranks_and_every_ranks_detail_from_the_stores():
    late = dict(STATUS, heartbeats={"1": {"age_s": 2.5, "step": 8}})
    assert "ranks late to beat: 1 (2.5s, step 8)" in format_status("gpt", late, 100.0)
    text = format_ranks(STATUS["assignment"], {"nodeA" + "a" * 20: {0: (0.2, 8)},
                                               "nodeB" + "b" * 20: "its store did not answer"})
    assert "  rank 0 on nodeAaaaaaaa: step 8, last sign of life 0.2s ago" in text.splitlines()
    assert "  node nodeBbbbbbbb: its store did not answer" in text.splitlines()


def test_snapshots_that_did_not_land_are_told_over_the_ranks():
    lines = format_status("gpt", dict(STATUS, snapshots={"requested": 16.0, "landed": 12.0,
                                                         "skipped": 4.0}), now=100.0)
    assert "snapshots landed 12 of 16 due over the ranks (4 skipped)" in lines.splitlines()
    every = format_status("gpt", dict(STATUS, snapshots={"requested": 16.0, "landed": 16.0}),
                          now=100.0)
    assert "due over the ranks" not in every


def test_no_standby_line_when_every_holder_runs_ranks():
    ring = dict(STATUS, holders={"0": [STATUS["assignment"]["1"]], "1": [STATUS["assignment"]["0"]]})
    assert "running no rank" not in format_status("gpt", ring, now=100.0)


def test_elastic_job_shows_its_size_last_resize_and_pending_growth():
    el = dict(STATUS, elastic={
        "world_size": 2, "num_workers": 3, "min_workers": 2, "pending_growth": 3,
        "last_resize": {"from": 3, "to": 2, "step": 5, "why": "rank 1's worker died",
                        "sources": {"0": ["ram:nodeA"], "1": ["ram:nodeC"]}}})
    lines = format_status("gpt", el, now=100.0).splitlines()
    assert "world size 2 of 3 (min 2)" in lines
    assert any(x.startswith("last resize: from 3 to 2 ranks at step 5 (rank 1's worker died)")
               for x in lines)
    assert "pending growth: to 3 ranks at the next committed step (nodes with room appeared)" \
        in lines
    assert "world size" not in format_status("gpt", STATUS, now=100.0)
