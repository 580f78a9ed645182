"""What the benchmark modules share: argument types, number formatting, the machine
description at the head of every report, the lines that close a report, and the
stand-alone command line (``python -m memckpt.bench.NAME`` and ``benchmarks/bench_*.py``).

Nothing here imports torch at module level, so building ``memckpt bench`` stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from pathlib import Path
from typing import Any, Callable, Optional

_GIB = 1 << 30


# -- command line -------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: use a whole number >= 1")
    return n


def standalone(prog: str, doc: Optional[str],
               add_arguments: Callable[[argparse.ArgumentParser], None],
               main: Callable[[argparse.Namespace], int],
               argv: Optional[list[str]] = None) -> int:
    """A benchmark module as its own program: the parser ``memckpt bench NAME`` builds for it
    (``prog``, the module's docstring as the description), then its ``main``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return main(parser.parse_args(argv))


def write_rows(path: Optional[str], rows: list[dict[str, Any]], indent: int = 2) -> None:
    """``--json PATH``: the rows as a JSON list (values JSON does not know as strings); nothing
    without a path."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=indent, default=str)


# -- formatting ---------------------------------------------------------------------------------
def human_bytes(n: Optional[float]) -> str:
    """1.50 GiB, 12.0 GiB, 3.20 MiB, 512 B; "–" for None."""
    if n is None:
        return "–"
    for unit, scale in (("GiB", _GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}" if n < 10 * scale else f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def human_s(s: Optional[float]) -> str:
    """1.25 s, 12.3 ms, 40 µs; "–" for None."""
    if s is None:
        return "–"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


# -- report -------------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """The machine a benchmark ran on (every row carries it; a report's first line shows it)."""
    import psutil
    import torch
    return {"cpus": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "cuda": torch.cuda.is_available(), "python": platform.python_version(),
            "platform": platform.platform()}


def machine_line(m: dict[str, Any], *more: str, threads: bool = False) -> str:
    """A report's first line: the machine of :func:`machine_info` (with torch's thread count
    if ``threads``), then ``more``, separated by "; "."""
    torch = f"torch {m['torch']}" + (f" ({m['torch_threads']} threads)" if threads else "")
    return "; ".join([f"machine: {m['cpus']} CPUs, {m['ram_bytes'] / _GIB:.0f} GiB RAM, "
                      f"{'CUDA' if m['cuda'] else 'CPU only'}, {torch}, Python {m['python']}",
                      *more])


def finish_report(text: list[str], rows: list[dict[str, Any]], busy_threshold: Optional[float],
                  worst_label: Callable[[dict[str, Any]], str],
                  checks: list[tuple[Optional[bool], str]], missed: str = "MISSED") -> str:
    """A report: its lines so far (``text``), then a warning when other processes took more
    than ``busy_threshold`` of the CPU during any row (``foreign_cpu``; None: no warning),
    naming the worst row by ``worst_label(row)``, then the targets, each met or ``missed``."""
    text = list(text)
    busy = [] if busy_threshold is None else \
        [r for r in rows if (r.get("foreign_cpu") or 0) > busy_threshold]
    if busy:
        worst = max(busy, key=lambda r: r["foreign_cpu"])
        text += ["", f"WARNING: other processes used up to {100 * worst['foreign_cpu']:.0f}% of the "
                     f"CPU during {len(busy)} of {len(rows)} measurements ({worst_label(worst)}): "
                     "those figures are not from a quiet machine"]
    if checks:
        text += ["", "targets:"] + [f"- {'met' if ok else missed}: {d}" for ok, d in checks]
    return "\n".join(text)
