"""The helpers every benchmark module shares (memckpt.bench.common): no Ray, no measurement."""

from __future__ import annotations

import argparse
import json

import pytest

from memckpt.bench import common


def test_positive_int():
    assert common.positive_int("3") == 3
    for bad in ("0", "-1", "x", "1.5"):
        with pytest.raises(argparse.ArgumentTypeError, match="invalid count"):
            common.positive_int(bad)


@pytest.mark.parametrize("n,text", [(None, "–"), (512, "512 B"), (1536, "1.50 KiB"),
                                    (100 << 20, "100.0 MiB"), (3 << 29, "1.50 GiB")])
def test_human_bytes(n, text):
    assert common.human_bytes(n) == text


@pytest.mark.parametrize("s,text", [(None, "–"), (2.5, "2.50 s"), (0.0123, "12.3 ms"),
                                    (4e-5, "40 µs")])
def test_human_s(s, text):
    assert common.human_s(s) == text


def test_machine_line():
    m = {"cpus": 2, "ram_bytes": 16 << 30, "cuda": False, "torch": "2.x", "torch_threads": 2,
         "python": "3.11"}
    assert common.machine_line(m) == "machine: 2 CPUs, 16 GiB RAM, CPU only, torch 2.x, Python 3.11"
    assert common.machine_line(m, "a", "b", threads=True) == \
        "machine: 2 CPUs, 16 GiB RAM, CPU only, torch 2.x (2 threads), Python 3.11; a; b"


def test_finish_report():
    rows = [{"method": "a", "foreign_cpu": 0.3}, {"method": "b", "foreign_cpu": 0.5},
            {"method": "c", "foreign_cpu": None}]
    text = common.finish_report(["head"], rows, 0.1, lambda r: r["method"],
                                [(True, "one"), (False, "two")])
    assert text.splitlines() == [
        "head", "",
        "WARNING: other processes used up to 50% of the CPU during 2 of 3 measurements (b): "
        "those figures are not from a quiet machine", "",
        "targets:", "- met: one", "- MISSED: two"]
    quiet = common.finish_report(["head"], rows, None, lambda r: r["method"], [(False, "x")],
                                 missed="NOT met")
    assert quiet.splitlines() == ["head", "", "targets:", "- NOT met: x"]
    assert common.finish_report(["head"], rows, 0.9, str, []) == "head"


def test_standalone_and_write_rows(tmp_path):
    seen = {}

    def add_arguments(parser):
        parser.add_argument("--json")

    def main(args):
        common.write_rows(args.json, [{"x": 1, "p": tmp_path}])
        seen["prog"] = True
        return 7

    out = tmp_path / "sub" / "rows.json"
    assert common.standalone("prog", "doc", add_arguments, main, ["--json", str(out)]) == 7
    assert seen and json.loads(out.read_text()) == [{"x": 1, "p": str(tmp_path)}]
    common.write_rows(None, [{"x": 1}])  # no path: nothing written
