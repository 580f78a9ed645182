"""The persistence benchmark runs (tiny sizes) against disk and a real S3 endpoint."""

from __future__ import annotations

import pytest

from memckpt.bench.persist.measure import run_persist_bench
from s3_server import aws_test_env, s3_endpoint, s3_uri  # noqa: F401 (fixtures)


def test_persist_bench_rows(s3_uri, s3_endpoint, monkeypatch):
    monkeypatch.setenv("MEMCKPT_S3_ENDPOINT_URL", s3_endpoint)
    rows = run_persist_bench([2 << 20], repeats=1, s3=s3_uri)
    methods = {r["method"]: r for r in rows}
    assert set(methods) == {"raw-disk-write", "memckpt-disk", "raw-s3-upload", "memckpt-s3"}
    for r in rows:
        assert r["median_s"] > 0 and r["throughput_Bps"] > 0
        assert r["state_bytes"] == pytest.approx(2 << 20, rel=0.2)
    assert methods["raw-disk-write"]["fraction_of_raw"] == 1.0


def test_persist_bench_cli_rejects_bad_sizes(capsys):
    from memckpt.cli import main
    with pytest.raises(SystemExit) as exc:
        main(["bench", "persist", "--sizes", "abc"])
    assert exc.value.code == 2 and "invalid size 'abc'" in capsys.readouterr().err
