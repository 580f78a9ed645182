"""Small filesystem helpers with crash-safe semantics."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path
from typing import Callable, Optional

import numpy as np

CHUNK = 64 << 20


def replace_atomic(path: Path, write: Callable[[Path], None],
                   mkdirs: Optional[Callable[[Path], None]] = None) -> None:
    """Make ``path`` the file ``write(tmp)`` creates, so a reader sees all of it or none of it.

    ``tmp`` is a fresh name next to ``path`` (the same filesystem); the file is fsynced,
    renamed over ``path``, and the directory fsynced so the rename survives a power cut.
    On any failure the temporary file is removed and ``path`` is untouched. ``mkdirs``
    creates the folder (default: like ``mkdir -p``); a folder removed concurrently before
    the write is made once more.
    """
    path = Path(path)
    make = mkdirs or (lambda d: d.mkdir(parents=True, exist_ok=True))
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        for attempt in (0, 1):
            make(path.parent)
            try:
                write(tmp)
                break
            except FileNotFoundError:
                if attempt:
                    raise
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_atomic(path: Path, data: np.ndarray | bytes | memoryview,
                 mkdirs: Optional[Callable[[Path], None]] = None) -> None:
    """Write the contiguous bytes ``data`` to ``path`` through :func:`replace_atomic`."""
    view = memoryview(data).cast("B")

    def write(tmp: Path) -> None:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "wb", buffering=0) as f:
            pos = 0
            while pos < len(view):
                n = f.write(view[pos: pos + CHUNK])
                if not n:
                    raise OSError(errno.EIO, "write returned 0 bytes")
                pos += n

    replace_atomic(path, write, mkdirs)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fs_type(path: Path) -> str:
    """Filesystem type of ``path`` from /proc/mounts (longest matching mount point)."""
    try:
        path = path.resolve()
        best, kind = "", "unknown"
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                if (str(path) == mnt or str(path).startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, fields[2]
        return kind
    except OSError:
        return "unknown"
