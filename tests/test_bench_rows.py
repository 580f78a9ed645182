"""The typed rows of ``memckpt bench recovery`` (memckpt.bench.recovery.rows): no Ray, no
measurement; samples shaped as RecoveryBench.measure returns them."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from memckpt.bench.recovery.rows import BASELINE, SHAPES, Row, Samples, build_rows


class _Bench:
    state_bytes = 4 << 20


def _recovery(total: float, peer: bool = False, peak_x: float = 4.0) -> dict:
    s = {"total_s": total, "phases_s": {"detect": 0.1, "total": total},
         "resume_split_s": {"fetch": 0.2}, "resumed_step": 3, "workers": [1, 2],
         "sources": [{"1": "local"}], "foreign_cpu": 0.1, "replication": [(1000, 0.01)],
         "peak_footprint_x": peak_x, "peak_footprint_bytes": int(peak_x * 2000),
         "state_slot_bytes": 2000, "peak_footprint_parts": {"n1/own/rank1": 2000}}
    if peer:
        s["peer_fetch"] = {"bytes": 1000, "seconds": 0.02}
    return s


def test_every_shape_names_fields_of_row():
    names = {f.name for f in fields(Row)}
    for shape, keys in SHAPES.items():
        assert set(keys) <= names, (shape, set(keys) - names)
        assert keys[:3] == ("benchmark", "method", "state_bytes"), shape


def test_an_unknown_shape_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="use one of recovery, baseline"):
        Row("recoveryy", "recovery", "m", 1, 1.0, "")


def test_rows_report_their_shape_keys_in_order_and_compare_with_the_same_failure():
    got = Samples(worker=[_recovery(1.0), _recovery(3.0)], node=[_recovery(2.0, peer=True)],
                  base=[{"total_s": 10.0, "phases_s": {"torch_load": 5.0}, "restart_s": 4.0,
                         "file_bytes": 999, "foreign_cpu": None}],
                  raw=[{"total_s": 0.01, "bytes": 1000, "foreign_cpu": 0.0}])
    rows = [r.to_dict() for r in build_rows(_Bench(), got, "tiny")]
    by = {r["method"]: r for r in rows}
    assert [r["method"] for r in rows] == ["memckpt-worker", "memckpt-node", BASELINE,
                                           "memckpt-peer-fetch", "memckpt-replication",
                                           "raw-tcp"]
    assert list(by["memckpt-worker"]) == list(SHAPES["recovery"])
    assert list(by["raw-tcp"]) == list(SHAPES["raw"])
    assert by["memckpt-worker"]["median_s"] == 2.0  # the median of 1 and 3
    assert by["memckpt-worker"]["speedup_vs_restart"] == 5.0
    # no lost-node alternative measured: the node row is held against the killed worker's
    assert by["memckpt-node"]["baseline"] == BASELINE
    assert by["memckpt-peer-fetch"]["ratio_to_raw"] == pytest.approx(0.5)
    json.dumps(rows)  # what --json writes


def test_recovery_rows_report_the_worst_host_ram_peak_beside_the_timings():
    from memckpt.bench.recovery.report import TARGET_FOOTPRINT_X, check_targets, format_table
    got = Samples(worker=[_recovery(1.0, peak_x=3.9), _recovery(3.0, peak_x=4.05)],
                  node=[_recovery(2.0, peer=True, peak_x=4.6)],
                  base=[{"total_s": 10.0, "phases_s": {}, "restart_s": 4.0, "file_bytes": 9,
                         "foreign_cpu": None}])
    rows = [r.to_dict() for r in build_rows(_Bench(), got, "tiny")]
    by = {r["method"]: r for r in rows}
    # the worst run's, not the median's: a bound holds for every run or it does not hold
    assert by["memckpt-worker"]["peak_footprint_x"] == 4.05
    assert by["memckpt-worker"]["peak_footprint_bytes"] == 8100
    assert by["memckpt-worker"]["peak_footprint_parts"] == {"n1/own/rank1": 2000}
    assert "peak_footprint_x" not in by[BASELINE]
    table = format_table(rows).splitlines()
    assert "| RAM peak / state |" in table[0]
    assert "| 4.05× (7.91 KiB) |" in next(x for x in table if "memckpt-worker" in x)
    targets = {d.split(":")[0]: ok for ok, d in check_targets(rows) if "host RAM" in d}
    assert targets == {"worker recovery": True, "node recovery": False}
    assert TARGET_FOOTPRINT_X == 4.1


def test_compare_settings_fill_sizes_and_refuse_bad_values_naming_the_field():
    from memckpt.bench.compare.command import CompareSettings
    from memckpt.errors import ConfigError
    s = CompareSettings(sizes=(("4M", 4 << 20), ("8M", 8 << 20)))
    assert s.recovery_sizes == (("8M", 8 << 20),) and s.scaling_size == ("4M", 4 << 20)
    assert CompareSettings().sizes == (("100M", 100 << 20), ("1G", 1 << 30))
    for bad, field_name in ((dict(parts=("stal",)), "parts"), (dict(steps=0), "steps"),
                            (dict(nodes=(1, 2)), "nodes"), (dict(kill_at=1), "kill_at"),
                            (dict(methods=()), "methods")):
        with pytest.raises(ConfigError, match=f"CompareSettings.{field_name}="):
            CompareSettings(**bad)


def test_ray_train_lost_work_holds_both_sides_to_the_fastest_compute():
    from memckpt.bench.ray_train.rows import KEYS
    from memckpt.bench.ray_train.rows import Row as RtRow
    from memckpt.bench.ray_train.rows import lost_work
    stall = [RtRow("stall", "memckpt", "2M", 100, 0.001, compute_s=0.2, samples=[0.001]),
             RtRow("stall", "ray-train-report", "2M", 100, 0.1, compute_s=0.25, samples=[0.1])]
    ours, theirs = lost_work(stall)
    # 5 % of the 0.2 s step affords a snapshot every step for memckpt, every 10 for the other
    assert (ours.interval_steps, theirs.interval_steps) == (1, 10)
    assert theirs.median == pytest.approx(10 / 2 * (0.2 + 0.1 / 10))
    assert list(theirs.to_dict()) == list(KEYS["lost_work"])
    with pytest.raises(ValueError, match="use one of stall, recovery, lost_work"):
        RtRow("stal", "m", "2M", 1, 1.0)


def test_compare_rows_leave_out_what_a_method_did_not_measure():
    from memckpt.bench.compare.rows import SHAPES, stall_rows
    raw = {"state_bytes": 100, "harness": {"memckpt": "memckpt.run"}, "methods": {
        m: {"step_s": [0.2, 0.3], "blocking_s": [0.01, 0.03], "compute_s": [0.1, 0.1], **extra}
        for m, extra in (("none", {}), ("memckpt", {"replicate_s": 0.05}),
                         ("dcp-async", {"persist_s": [0.5]}))}}
    rows = {r["method"]: r for r in stall_rows("2M", raw, 2, None)}
    assert list(rows) == ["none", "memckpt", "dcp-async"]  # in STALL_METHODS' order
    assert list(rows["none"]) == [k for k in SHAPES["stall"] if k not in (
        "persist_s", "write_s", "report_s", "replicate_s", "store_bytes", "raytrain_poll_s")]
    assert rows["memckpt"]["replicate_s"] == 0.05 and rows["memckpt"]["harness"] == "memckpt.run"
    assert rows["dcp-async"]["persist_s"] == 0.5 and "replicate_s" not in rows["dcp-async"]
    assert rows["memckpt"]["blocking_s"] == pytest.approx(0.02)


def test_a_stall_below_the_noise_is_zero_and_takes_no_ratio():
    """On a loaded machine a tiny state's step-time increase and extra blocking can both come
    out negative (two noisy medians subtracted): the stall is 0, not negative, and no ratio
    divides by it (a ZeroDivisionError once ended the whole benchmark)."""
    from memckpt.bench.compare.rows import derive, stall_rows
    raw = {"state_bytes": 2 << 20, "harness": {}, "methods": {
        "none": {"step_s": [0.030, 0.031], "blocking_s": [0.0, 0.0], "compute_s": [0.02] * 2},
        "memcpy": {"step_s": [0.001, 0.001], "blocking_s": [0.001, 0.001], "compute_s": [0.0] * 2},
        "memckpt-none": {"step_s": [0.031, 0.032], "blocking_s": [0.004, 0.004],
                         "compute_s": [0.02] * 2},
        # faster than its baseline and blocking less: the noise, not the checkpoint
        "memckpt": {"step_s": [0.030, 0.030], "blocking_s": [0.003, 0.003],
                    "compute_s": [0.02] * 2, "replicate_s": 0.01},
        "torch.save": {"step_s": [0.040, 0.042], "blocking_s": [0.01, 0.012],
                       "compute_s": [0.02] * 2}}}
    rows = {r["method"]: r for r in derive(stall_rows("2M", raw, 2, None))
            if r["benchmark"] == "stall"}
    assert rows["memckpt"]["stall_s"] == rows["memckpt"]["median"] == 0.0
    assert rows["memckpt"]["x_memcpy"] == 0.0 and rows["memckpt"]["fraction_of_limit"] is None
    assert rows["torch.save"]["x_memckpt"] is None  # not against a stall of 0
    assert rows["torch.save"]["x_memcpy"] == pytest.approx(rows["torch.save"]["stall_s"] / 0.001)
