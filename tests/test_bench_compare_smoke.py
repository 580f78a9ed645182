"""Smoke test of ``memckpt bench compare``: tiny sizes, every part, every method, the JSON rows,
the table and the PNG, so the benchmark never rots. Three tests (stall + lost work, recovery,
scaling), so each stays short (about a minute here)."""

from __future__ import annotations

import argparse
import json

import pytest

from memckpt import cli
from memckpt.bench.compare import command as compare
from memckpt.bench.compare import report as compare_report
from memckpt.bench.compare import rows as compare_rows
from memckpt.bench.compare import plot

# Ray Train with its controller polling every 0.1 s (not Ray's default 2 s) carries the poll
STALL = {"none", "memcpy", "raw-disk-write", "memckpt-local", "memckpt-none", "memckpt",
         "torch.save", "dcp-async", "ray-train-none-poll0.1s", "ray-train-poll0.1s"}
LOST = {"memckpt-local", "memckpt", "torch.save", "dcp-async", "ray-train-poll0.1s"}
SCALING = {"memckpt-none", "memckpt-k1", "memckpt-k1-memory", "memckpt-k2", "memckpt-k2-memory"}
FIELDS = ("benchmark", "method", "state_bytes", "median", "unit")


def _common(rows):
    for r in rows:
        for f in FIELDS:
            assert f in r, (f, r)
        assert r["benchmark"] in compare.PARTS
        # a stall is a difference of two noisy medians: at 2 MiB on a loaded machine it can
        # be below the noise, reported as 0 (rows.ratio); every other figure is measured
        diff = r["benchmark"] == "stall" and "own_blocking_s" in r
        assert r["median"] >= 0 if diff else r["median"] > 0, r
        assert r["state_bytes"] > 0, r
    json.dumps(rows)  # JSON-able


@pytest.mark.ray
@pytest.mark.timeout(420)  # 75 s on a quiet machine here; CI machines are shared
def test_stall_and_lost_work(tmp_path, capsys):
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    rc = cli.main(["bench", "compare", "--parts", "stall,lost_work", "--sizes", "2M",
                   "--steps", "2", "--step-s", "0.02", "--raytrain-poll-s", "0.1",
                   "--dir", str(tmp_path / "disk"), "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rows = json.loads(out.read_text())
    _common(rows)
    stall = {r["method"]: r for r in rows if r["benchmark"] == "stall"}
    assert set(stall) == STALL
    memcpy = stall["memcpy"]["median"]
    for m, r in stall.items():
        assert abs(r["state_bytes"] - 2 * 2**20) < 0.1 * 2 * 2**20, r
        if compare_rows.is_baseline(m):
            assert r["median"] == r["step_s"]
            continue
        assert r["blocking_s"] > 0
        assert r["median"] >= r.get("own_blocking_s", r["blocking_s"])  # at least what it blocks
        assert r["x_memcpy"] == pytest.approx(compare_rows.ratio(r["median"], memcpy))
        if m not in compare_rows.LIMITS:
            assert r["x_memckpt"] == pytest.approx(
                compare_rows.ratio(r["median"], stall["memckpt"]["median"]))
    assert stall["memckpt"]["store_bytes"]  # read from the stores
    lost = {r["method"]: r for r in rows if r["benchmark"] == "lost_work"}
    assert set(lost) == LOST
    for r in lost.values():
        assert r["unit"] == "steps" and r["interval_steps"] >= 1
        assert r["overhead_at_interval"] <= compare_rows.OVERHEAD_BUDGET + 1e-9
        assert r["median"] >= r["interval_steps"] / 2
    printed = capsys.readouterr().out
    # Ray's own lines (a raylet's warning) may come first: the report's first line is there
    assert any(line.startswith("machine:") for line in printed.splitlines()), printed[:2000]
    assert "| benchmark | method | state | median | × memcpy | × memckpt | details |" in printed
    assert "targets:" in printed
    _png_size(png)


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_scaling(tmp_path, full_cluster):
    rows = compare.run_compare(compare.CompareSettings(
        ("scaling",), tuple(compare.parse_sizes("4M")), steps=2, step_s=0.02,
        directory=str(tmp_path), nodes=(3,)), log=lambda _m: None, cluster=full_cluster)
    _common(rows)
    scaling = {(r["method"], r["nodes"]) for r in rows if r["benchmark"] == "scaling"}
    assert {m for m, _ in scaling} == SCALING
    assert {n for _, n in scaling} == {3}
    for r in rows:
        if r["method"].endswith("-memory"):
            assert r["unit"] == "bytes"
            assert r["x_state"] == pytest.approx(r["expected_x_state"], rel=0.2)


# Only the recoveries no other smoke test measures, plus memckpt-worker to set them against:
# memckpt-node, restart+torch.load (after a killed worker or a lost node) are the same
# RecoveryBench calls tests/test_bench_recovery_smoke.py makes, and ray-train-restore the
# same raytrain_recovery tests/test_bench_ray_train_smoke.py runs (a Ray Train run with a
# restart: ~60 s here). Every method's row is derived from samples without a cluster below
# (test_recovery_rows_derive_against_the_same_failure).
SMOKE_RECOVERY = ("memckpt-worker", "restart+dcp.load")


@pytest.mark.ray
@pytest.mark.timeout(300)  # on a loaded 2-core machine 180 s ran out for four recoveries
def test_recovery(tmp_path, full_cluster):
    rows = compare.run_compare(compare.CompareSettings(
        ("recovery",), tuple(compare.parse_sizes("4M")), directory=str(tmp_path),
        recovery_compute_iters=2, kill_at=3, raytrain_poll_s=0.1,
        recovery_methods=SMOKE_RECOVERY), log=lambda _m: None, cluster=full_cluster)
    _common(rows)
    rec = {r["method"]: r for r in rows if r["benchmark"] == "recovery"}
    assert set(rec) == set(SMOKE_RECOVERY)
    alternatives = [m for m in compare_rows.ALTERNATIVES if m in rec]
    assert alternatives == ["restart+dcp.load"]
    fastest = min(rec[m]["median"] for m in alternatives)
    assert rec["memckpt-worker"]["speedup_vs_fastest_alternative"] == pytest.approx(
        fastest / rec["memckpt-worker"]["median"])
    assert set(rec["memckpt-worker"]["sources"][0].values()) == {"local"}
    for m in alternatives:
        assert rec[m]["phases_s"]["total"] == pytest.approx(rec[m]["median"])
        assert rec[m]["phases_s"]["torch_load"] > 0
    png = plot.plot_compare(rows, tmp_path / "rec.png")
    _png_size(png)


def test_recovery_rows_derive_against_the_same_failure():
    """Every recovery method's row, from samples shaped as the measurements return them:
    the node row is set against the alternative after the same node loss."""
    def sample(total, memckpt=False, **extra):
        s = {"total_s": total, "phases_s": {"detect": 0.1, "torch_load": 0.2, "total": total}}
        if memckpt:
            s.update(resume_split_s={"fetch": 0.1, "load": 0.1}, sources={"0": "local"})
        return s | extra
    samples = {m: [sample(t, m.startswith("memckpt"))] for m, t in (
        ("memckpt-worker", 1.0), ("restart+torch.load", 4.0), ("restart+dcp.load", 5.0),
        ("ray-train-restore", 9.0), (compare_rows.BASELINE_NODE, 6.0))}
    samples["memckpt-node"] = [sample(2.0, True, peer_fetch={"seconds": 0.5, "src": "a",
                                                             "dst": "b", "bytes": 1})]
    rows = compare_rows.recovery_rows("4M", 4 * 2**20, samples, [{"total_s": 0.25}], 0.1)
    compare_rows.derive_recovery(rows)
    rec = {r["method"]: r for r in rows}
    assert set(rec) == set(compare_rows.RECOVERY_METHODS)
    assert rec["memckpt-node"]["speedup_vs_same_failure"] == pytest.approx(3.0)
    assert rec["memckpt-node"]["speedup_vs_fastest_alternative"] == pytest.approx(2.0)
    assert rec["memckpt-worker"]["speedup_vs_fastest_alternative"] == pytest.approx(4.0)
    assert rec["memckpt-node"]["fraction_of_limit"] == pytest.approx(0.5)
    assert "after the same node loss" in compare_report.format_table(rows)
    assert any("the same failure" in text for _, text in compare_report.check_targets(rows))


def _png_size(path):
    from PIL import Image
    assert path.exists() and path.stat().st_size < 400_000
    with Image.open(path) as im:
        assert im.size == (plot.WIDTH_PX, plot.HEIGHT_PX)


def test_arguments():
    parser = argparse.ArgumentParser()
    compare.add_arguments(parser)
    args = parser.parse_args([])
    # no --parts: every part, or only the peers' side by side with --peers
    assert args.parts is None and args.steps == 5 and args.peers == ()
    assert args.recovery_methods == compare_rows.RECOVERY_METHODS
    assert parser.parse_args(["--recovery-methods", "memckpt-worker,ray-train-restore"]
                             ).recovery_methods == ("memckpt-worker", "ray-train-restore")
    for bad in (["--parts", "stall,bogus"], ["--step-s", "0"], ["--sizes", "1G,"],
                ["--nodes", "1,2"], ["--recovery-methods", "memckpt"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_from_json_rederives(tmp_path, capsys):
    """Per-part runs merge: ratios and lost work are derived again from the measured rows."""
    machine = {"cpus": 2, "ram_bytes": 1 << 34, "cuda": False, "torch": "x", "python": "3"}
    def row(m, step, blocking, harness="process"):
        return {"benchmark": "stall", "method": m, "size": "1G", "state_bytes": 1 << 30,
                "harness": harness, "step_s": step, "blocking_s": blocking, "compute_s": 1.0,
                "machine": machine}
    a = [row("none", 1.0, 0.0), row("memcpy", 0.1, 0.1), row("torch.save", 3.0, 2.0),
         row("memckpt-none", 1.0, 0.0, "memckpt.run"), row("memckpt", 1.12, 0.11, "memckpt.run")]
    (tmp_path / "a.json").write_text(json.dumps(a))
    assert cli.main(["bench", "compare", "--from-json", str(tmp_path / "a.json"),
                     "--json", str(tmp_path / "all.json")]) == 0
    rows = json.loads((tmp_path / "all.json").read_text())
    by = {(r["benchmark"], r["method"]): r for r in rows}
    assert by[("stall", "memckpt")]["median"] == pytest.approx(0.12)
    assert by[("stall", "torch.save")]["x_memckpt"] == pytest.approx(2.0 / 0.12)
    assert by[("lost_work", "memckpt")]["interval_steps"] == 3  # 0.12 / (5% of 1 s)
    assert by[("lost_work", "torch.save")]["interval_steps"] == 40
    assert "NOT met" in capsys.readouterr().out
