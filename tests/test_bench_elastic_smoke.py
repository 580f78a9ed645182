"""Smoke test of ``memckpt bench elastic`` at a tiny state: both rows, through the CLI."""

from __future__ import annotations

import json

import pytest

from memckpt.cli import main

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_elastic_bench_rows(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "elastic", "--state-mb", "4", "--steps", "6",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["method"] for r in rows] == ["memckpt elastic (RAM reshard)",
                                           "restart + DCP load (disk)"]
    for r in rows:
        assert r["seconds"] > 0 and (r["from_world_size"], r["to_world_size"]) == (3, 2)
        assert r["step"] == 3
        # node death -> every rank loaded comes first, inside the whole figure
        assert r["detect_s"] < r["restored_s"] < r["seconds"], r
    assert "speed-up" in capsys.readouterr().out
