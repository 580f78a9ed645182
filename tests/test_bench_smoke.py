"""Smoke test of ``memckpt bench snapshot``: a tiny state, every method, the JSON rows, bad usage."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess

import pytest

from memckpt import cli
from memckpt.bench.common import parse_size
from memckpt.bench.snapshot.command import METHODS


@pytest.fixture
def memckpt_main(monkeypatch):
    """``memckpt.cli.main``; other sub-commands are left out while their modules do not exist yet."""
    if importlib.util.find_spec("memckpt.cli.demo") is None:
        monkeypatch.setattr(cli, "COMMANDS", {"bench": cli.COMMANDS["bench"]})
    return cli.main


@pytest.mark.timeout(120)
def test_snapshot_bench_writes_every_method(memckpt_main, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = memckpt_main(["bench", "snapshot", "--sizes", "2M", "--repeats", "2", "--json", str(out),
                       "--dir", str(tmp_path / "disk"), "--ram-root", str(tmp_path / "ram")])
    assert rc == 0
    rows = json.loads(out.read_text())
    assert sorted(r["method"] for r in rows) == sorted(METHODS)
    for r in rows:
        assert r["stall_s"] > 0, r
        assert r["repeats"] == 2 and len(r["stalls_s"]) == 2
        assert abs(r["state_bytes"] - 2 * 2**20) <= 0.1 * 2 * 2**20, r
        assert r["peak_rss_bytes"] > r["state_bytes"]
        assert r["ratio_to_memcpy"] > 0
    by = {r["method"]: r for r in rows}
    assert by["memcpy"]["ratio_to_memcpy"] == pytest.approx(1.0)
    assert by["memckpt"]["allocations_flat"] is True
    assert by["memckpt-overlap"]["allocations_flat"] is True
    printed = capsys.readouterr().out
    assert "| method | state size | median stall | × memcpy | × memckpt | peak RSS |" in printed
    for m in METHODS:
        assert f"| {m} |" in printed
    assert not list((tmp_path / "ram").iterdir()), "slots must be freed after the run"
    assert not list((tmp_path / "disk").iterdir()), "torch.save-disk must remove its file"


@pytest.mark.timeout(120)
def test_train_overhead_bench_runs_every_loop_on_cpu(memckpt_main, tmp_path, capsys):
    out = tmp_path / "rows.json"
    rc = memckpt_main(["bench", "train-overhead", "--size", "2M", "--steps", "3",
                       "--compute-ms", "5", "--json", str(out), "--ram-root", str(tmp_path / "ram")])
    assert rc == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["none", "sync-wait", "sync-skip", "overlap-wait", "overlap-skip"]
    assert rows["none"]["overhead"] is None and rows["none"]["requested"] == 0
    for name, r in rows.items():
        assert len(r["step_times_s"]) == 3 and r["step_s"] > 0
        if name != "none":
            assert r["requested"] == 3 and r["overhead"] is not None and r["seal_threads"] >= 1
            # wait: every due snapshot lands; skip: what landed is counted, never more
            assert r["landed"] == 3 if name.endswith("wait") else 1 <= r["landed"] <= 3
    printed = capsys.readouterr().out
    assert "| loop | state | step time | overhead | snapshots landed |" in printed
    assert "| sync-wait |" in printed and "3 of 3" in printed
    assert not list((tmp_path / "ram").iterdir()), "slots must be freed after the run"


def test_train_overhead_refuses_a_bad_compute_time(memckpt_main, capsys):
    assert memckpt_main(["bench", "train-overhead", "--compute-ms", "0"]) == 2
    assert "--compute-ms must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--sizes", "0"], ["--sizes", "abc"], ["--sizes", "1G,"],
                                  ["--repeats", "0"], ["--mode", "async"]])
def test_bad_arguments_exit_with_usage(memckpt_main, argv, capsys):
    with pytest.raises(SystemExit) as exc:
        memckpt_main(["bench", "snapshot", *argv])
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert "usage:" in err and "error:" in err


def test_help_lists_the_options(memckpt_main, capsys):
    with pytest.raises(SystemExit) as exc:
        memckpt_main(["bench", "snapshot", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--sizes", "--repeats", "--json", "--mode", "--dir"):
        assert opt in out


def test_bench_needs_a_benchmark(memckpt_main, capsys):
    with pytest.raises(SystemExit) as exc:
        memckpt_main(["bench"])
    assert exc.value.code != 0
    assert "snapshot" in capsys.readouterr().err


@pytest.mark.parametrize("text,expected", [("512K", 512 * 2**10), ("100M", 100 * 2**20),
                                           ("1G", 2**30), ("4g", 4 * 2**30), ("1.5GiB", 3 * 2**29),
                                           ("100MB", 100 * 2**20), ("1048576", 2**20)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_evicting_a_folder_keeps_its_bytes_and_counts_them(tmp_path):
    """The benchmarks' cold reads: every file under a folder (or one file) flushed and dropped
    from the page cache, its contents unchanged."""
    from memckpt.bench.common import evict_from_page_cache
    (tmp_path / "sub").mkdir()
    files = {tmp_path / "a.bin": b"x" * 5000, tmp_path / "sub" / "b.bin": b"y" * 123}
    for path, data in files.items():
        path.write_bytes(data)
    assert evict_from_page_cache(tmp_path) == 5123
    assert evict_from_page_cache(tmp_path / "a.bin") == 5000
    assert all(path.read_bytes() == data for path, data in files.items())
    from memckpt.util.fsutil import fs_type
    # util-linux's fincore: the files' pages in the page cache, now none (a RAM filesystem
    # keeps its pages: they are the files)
    if shutil.which("fincore") and fs_type(tmp_path) not in ("tmpfs", "ramfs"):
        evict_from_page_cache(tmp_path)
        resident = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES",
                                   *map(str, files)], capture_output=True, text=True, check=True)
        assert [int(n) for n in resident.stdout.split()] == [0, 0]
