"""Small filesystem helpers with crash-safe semantics."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

CHUNK = 64 << 20


def write_atomic(path: Path, data: np.ndarray | bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees all of it or none of it.

    Data goes to a temporary name in the same directory, is fsynced, then renamed
    over ``path``; the directory is fsynced so the rename survives a power cut.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    view = memoryview(data).cast("B")
    try:
        with open(tmp, "wb") as f:
            for start in range(0, len(view), CHUNK):
                f.write(view[start: start + CHUNK])
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
