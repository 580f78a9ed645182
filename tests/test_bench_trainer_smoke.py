"""Smoke test of ``memckpt bench trainer``: a tiny GPT-2, two steps, every row and ratio, the
report; so the benchmark never rots."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

from memckpt import cli  # noqa: E402


@pytest.mark.timeout(600)
def test_trainer_bench_rows_and_report(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = cli.main(["bench", "trainer", "--sizes", "2M", "--steps", "2", "--dir", str(tmp_path),
                   "--json", str(out)])
    assert rc == 0
    rows = json.loads(out.read_text())
    step = {r["method"]: r for r in rows if r["benchmark"] == "step"}
    resume = {r["method"]: r for r in rows if r["benchmark"] == "resume"}
    assert set(step) == {"none", "hf-save", "memckpt", "memckpt-overlap",
                         "lightning-none", "lightning-checkpoint", "lightning-memckpt"}
    assert set(resume) == {"hf-resume", "hf-resume-warm", "memckpt"}
    for framework, mode in (("", ""), ("", "-overlap"), ("lightning-", "")):
        # each memckpt row against its framework's own save
        none, own = step[framework + "none"], step[framework + ("checkpoint" if framework else "hf-save")]
        mine = step[framework + "memckpt" + mode]
        assert none["blocking_s"] == 0 and own["blocking_s"] > 0 and mine["blocking_s"] > 0
        assert mine["x_lower_blocking"] == pytest.approx(own["blocking_s"] / mine["blocking_s"])
        assert mine["overhead_s"] == pytest.approx(mine["step_s"] - none["step_s"])
    for r in resume.values():  # both resumed the last step the killed / saving run reached
        assert r["resumed_step"] == 2 and 0 < r["restore_s"] < r["to_first_step_s"]
    assert resume["memckpt"]["x_faster_restore"] == pytest.approx(
        resume["hf-resume"]["restore_s"] / resume["memckpt"]["restore_s"])
    assert resume["memckpt"]["x_faster_restore_warm"] == pytest.approx(
        resume["hf-resume-warm"]["restore_s"] / resume["memckpt"]["restore_s"])
    assert len({r["state_bytes"] for r in rows}) == 1 and rows[0]["state_bytes"] > 2**20
    printed = capsys.readouterr().out
    assert printed.startswith("machine:") and "| size | per step |" in printed
    assert "targets:" not in printed  # the targets are for 1 GiB and up
    assert not list(tmp_path.glob("memckpt-bench-trainer-*"))  # its checkpoint folders removed
