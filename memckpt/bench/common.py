"""What the benchmark modules share: argument types, number formatting, scratch
directories, a measurement in a fresh process, the machine description at the head of
every report, the lines that close a report, and the stand-alone command line
(``python -m memckpt.bench.NAME`` and ``benchmarks/bench_*.py``).

Nothing here imports torch at module level, so building ``memckpt bench`` stays cheap.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Any, Callable, ClassVar, Mapping, NoReturn, Optional, Sequence

from memckpt.policy.footprint import human_bytes  # noqa: F401 (the bench's formatter)
from memckpt.errors import ConfigError

GIB = 1 << 30
MIN_SIZE = 64 * 1024
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


# -- command line -------------------------------------------------------------------------------
class KindedRow:
    """Base of a frozen dataclass row with several kinds: the value of its field named ``KIND``
    picks the keys (``KEYS[kind]``) the row reports, in the order the JSON output has them."""

    KIND: ClassVar[str]
    KEYS: ClassVar[Mapping[str, tuple[str, ...]]]
    OPTIONAL: ClassVar[frozenset[str]] = frozenset()  # keys left out while their value is None

    def __post_init__(self) -> None:
        kind = getattr(self, self.KIND)
        if kind not in self.KEYS:
            raise ValueError(f"{type(self).__name__}({self.KIND}={kind!r}): use one of "
                             f"{', '.join(self.KEYS)}")

    def to_dict(self) -> dict[str, Any]:
        """The row as ``--json`` writes it and the report reads it: its kind's keys, in order."""
        return {k: getattr(self, k) for k in self.KEYS[getattr(self, self.KIND)]
                if k not in self.OPTIONAL or getattr(self, k) is not None}


def positive_int(text: str) -> int:
    """argparse type: a whole number >= 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: use a whole number >= 1")
    return n


def parse_size(text: str) -> int:
    """``"100M"`` -> 104857600. Binary units K, M, G, T; an optional ``B``/``iB``; plain bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: write a number with an optional unit, e.g. 512K, 100M, 1G, 4G")
    n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n < MIN_SIZE:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: a state must be at least 64K")
    return n


def parse_sizes(text: str) -> list[tuple[str, int]]:
    """``"100M,1G"`` -> [("100M", 104857600), ("1G", 1073741824)]."""
    parts = [p.strip() for p in text.split(",")]
    if not any(parts) or not all(parts):
        raise argparse.ArgumentTypeError(f"invalid size list {text!r}: give sizes separated by "
                                         "commas, e.g. 100M,1G,4G")
    return [(p.upper().replace("IB", "").replace("B", ""), parse_size(p)) for p in parts]


def standalone(prog: str, doc: Optional[str],
               add_arguments: Callable[[argparse.ArgumentParser], None],
               main: Callable[[argparse.Namespace], int],
               argv: Optional[list[str]] = None) -> int:
    """A benchmark module as its own program: the parser ``memckpt bench NAME`` builds for it
    (``prog``, the module's docstring as the description), then its ``main``."""
    parser = argparse.ArgumentParser(prog=prog, description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except ConfigError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2


def write_rows(path: Optional[str], rows: list[dict[str, Any]], indent: int = 2) -> None:
    """``--json PATH``: the rows as a JSON list (values JSON does not know as strings); nothing
    without a path."""
    if not path:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(rows, f, indent=indent, default=str)


# -- scratch space and child processes --------------------------------------------------------
def disk_base() -> Path:
    """Where a benchmark's files go by default: tempfile's directory, unless that is a RAM
    filesystem (then the working directory), so a disk figure measures a disk."""
    from memckpt.util.fsutil import fs_type
    base = Path(tempfile.gettempdir())
    return Path.cwd() if fs_type(base) in ("tmpfs", "ramfs") else base


def usable_dir(path: str, flag: str = "--dir") -> Path:
    """``path`` as a directory we can write in (made if missing); ConfigError naming ``flag``
    otherwise, before anything is measured."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        if not os.access(p, os.W_OK | os.X_OK):
            raise PermissionError(13, "not writable")
    except OSError as e:
        raise ConfigError(f"{flag} {path!r} is invalid: {e.strerror or e}; give a writable "
                          "directory") from None
    return p


def disk_dir(directory: Optional[str], prefix: str) -> Path:
    """A fresh directory for a run's files inside ``directory`` (made if missing), or inside
    :func:`disk_base`; the caller removes it."""
    base = usable_dir(directory) if directory else disk_base()
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def ram_dir(prefix: str) -> Path:
    """A fresh directory in /dev/shm (tempfile's directory where that is not writable)."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def evict_from_page_cache(path: Path) -> int:
    """Flush a file (or every file under a folder) to disk and drop its pages from the page
    cache, so the next read comes from the disk as after a reboot or on another machine.
    Returns the bytes evicted."""
    total = 0
    for f in [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file()):
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        total += f.stat().st_size
    return total


def rows_from_child(module: str, args: list[str], out_flag: str, what: str) -> Any:
    """Run ``python -m module args out_flag FILE`` with this memckpt first on PYTHONPATH (a
    fresh process: its memory is returned afterwards) and return the JSON it wrote to FILE.
    Its output goes to our stderr. RuntimeError naming ``what`` when it fails."""
    import memckpt
    root = str(Path(memckpt.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    fd, out = tempfile.mkstemp(prefix="memckpt-bench-rows-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", module, *args, out_flag, out]
    try:
        try:  # the child's progress goes to our stderr (through a pipe if that has no fd)
            err: Optional[int] = sys.stderr.fileno()
        except (AttributeError, ValueError, OSError):
            err = None
        if err is not None:
            returncode = subprocess.run(cmd, env=env, stdout=err, stderr=err).returncode
        else:
            piped = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                   text=True)
            sys.stderr.write(piped.stdout)
            returncode = piped.returncode
        if returncode != 0:
            raise RuntimeError(f"{what} exited with {returncode}")
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)


# -- spawned ranks ------------------------------------------------------------------------------
def end_rank_process() -> NoReturn:
    """The end of a spawned rank's process, once its results are written: destroy the
    process group, then leave without the interpreter's teardown. Gloo's threads and the
    objects that still hold the group (a DTensor's device mesh) are torn down at exit in no
    fixed order, and a rare order aborts the process ("terminate called without an active
    exception", pytorch/pytorch#190489): a run whose results were all written failed."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_failure(phase: str, work: str, error: BaseException) -> RuntimeError:
    """What a failed spawn of ranks says: the phase, each rank's own error file
    (``error-*.txt`` in ``work``, written by the rank) and the files the ranks left."""
    errors = sorted(Path(work).glob("error-*.txt"))
    told = "\n".join(f"--- {e.name}\n{e.read_text()}" for e in errors)
    left = sorted(p.name for p in Path(work).iterdir() if p.is_file())
    return RuntimeError(f"{phase}: {error}\n{told or 'no rank wrote an error (a signal or an abort)'}"
                        f"\nfiles the ranks left: {left}")


# -- formatting ---------------------------------------------------------------------------------
def human_s(s: Optional[float]) -> str:
    """1.25 s, 12.3 ms, 40 µs; "–" for None."""
    if s is None:
        return "–"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} µs"


def med(values: Any) -> Optional[float]:
    """The median of the values that are not None; None when there are none."""
    vals = [v for v in values if v is not None]
    return float(median(vals)) if vals else None


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
    return "; ".join([f"machine: {m['cpus']} CPUs, {m['ram_bytes'] / GIB:.0f} GiB RAM, "
                      f"{'CUDA' if m['cuda'] else 'CPU only'}, {torch}, Python {m['python']}",
                      *more])


def finish_report(text: list[str], rows: list[dict[str, Any]], busy_threshold: Optional[float],
                  worst_label: Callable[[dict[str, Any]], str],
                  checks: Sequence[tuple[Optional[bool], str]], missed: str = "MISSED") -> str:
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
