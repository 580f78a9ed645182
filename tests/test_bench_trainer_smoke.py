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
    assert set(step) == {"none", "hf-save", "memckpt"}
    assert set(resume) == {"hf-resume", "hf-resume-warm", "memckpt"}
    assert step["none"]["blocking_s"] == 0 and step["hf-save"]["blocking_s"] > 0
    assert step["memckpt"]["blocking_s"] > 0
    assert step["memckpt"]["x_lower_blocking"] == pytest.approx(
        step["hf-save"]["blocking_s"] / step["memckpt"]["blocking_s"])
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
