"""A local directory (or network filesystem) as a storage backend.

A ``put`` goes to a unique temporary name in the same directory, is fsynced, renamed over
the key and the directory fsynced (new directories are fsynced into their parents too),
so a completed ``put`` survives a power cut and a reader never sees a torn object. A key
whose directory resolves (through symlinks) outside the root is refused.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from memckpt.util.fsutil import fsync_dir, write_atomic
from memckpt.persist.backend import (
    CHUNK,
    Data,
    StorageBackend,
    as_bytes_view,
    check_key,
    check_prefix,
    check_range,
)
from memckpt.errors import ObjectNotFoundError, PersistError, UnsafeKeyError

_RETRYABLE_ERRNOS = {errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.EIO, errno.EBUSY,
                     getattr(errno, "ESTALE", -1), getattr(errno, "ECONNRESET", -1)}
_OS_HINTS = {
    errno.ENOSPC: "the disk is full: free space or lower keep_last",
    errno.EDQUOT: "the disk quota is exhausted: free space or lower keep_last",
    errno.EACCES: "permission denied: check the directory's owner and mode",
    errno.EPERM: "permission denied: check the directory's owner and mode",
    errno.EROFS: "the filesystem is read-only: choose a writable directory",
    errno.ENOTDIR: "a path component is a file, not a directory: check the checkpoint root",
    errno.EISDIR: "the key names a directory",
}


class LocalBackend(StorageBackend):
    """A directory on a local or network filesystem (created on first write)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.path.expanduser(os.fspath(root))))

    def describe(self) -> str:
        return str(self.root)

    def _error(self, op: str, key: str, e: OSError) -> PersistError:
        if isinstance(e, FileNotFoundError) and op in ("get", "read"):
            return ObjectNotFoundError(f"{self.describe()}: {key!r} does not exist", uri=self.describe())
        hint = _OS_HINTS.get(e.errno or 0, "check the path, its permissions and free space")
        return PersistError(f"{op} {key!r} under {self.describe()} failed: {e.strerror or e}: {hint}",
                            retryable=(e.errno in _RETRYABLE_ERRNOS), uri=self.describe())

    def _path(self, key: str) -> Path:
        check_key(key)
        path = self.root.joinpath(*key.split("/"))
        # A symlinked directory inside the root must not lead outside it.
        parent = path.parent
        while not parent.exists() and parent != self.root and self.root in parent.parents:
            parent = parent.parent
        real_root = os.path.realpath(self.root)
        real = os.path.realpath(parent)
        if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
            raise UnsafeKeyError(f"key {key!r} resolves outside {self.describe()} (through a "
                                 "symlink): refusing to touch it")
        return path

    def _mkdirs(self, directory: Path) -> None:
        """Create missing directories one by one, fsyncing each new entry into its parent."""
        missing = []
        d = directory
        while not d.is_dir():
            missing.append(d)
            if d == d.parent:
                break
            d = d.parent
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue
            fsync_dir(d.parent)

    def put(self, key: str, data: Data) -> None:
        path = self._path(key)
        try:
            write_atomic(path, as_bytes_view(data), mkdirs=self._mkdirs)
        except OSError as e:
            raise self._error("put", key, e) from e

    def get(self, key: str) -> np.ndarray:
        path = self._path(key)
        try:
            with open(path, "rb", buffering=0) as f:
                size = os.fstat(f.fileno()).st_size
                out = np.empty(size, dtype=np.uint8)
                view, pos = memoryview(out), 0
                while pos < size:
                    n = f.readinto(view[pos: pos + CHUNK])
                    if not n:  # shrank while read: return what is there, checksums judge it
                        return out[:pos].copy()
                    pos += n
                return out
        except OSError as e:
            raise self._error("get", key, e) from e

    def get_range(self, key: str, offset: int, length: int) -> np.ndarray:
        check_range(offset, length)
        path = self._path(key)
        out = np.empty(length, dtype=np.uint8)
        view, pos = memoryview(out), 0
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                while pos < length:
                    n = os.preadv(fd, [view[pos: pos + CHUNK]], offset + pos)
                    if not n:  # the object ends first
                        return out[:pos].copy()
                    pos += n
            finally:
                os.close(fd)
        except OSError as e:
            raise self._error("read", key, e) from e
        return out

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        check_prefix(prefix)
        base_key = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root.joinpath(*base_key.split("/")) if base_key else self.root
        out: dict[str, int] = {}
        if not base.is_dir():
            return out
        try:
            for dirpath, dirnames, filenames in os.walk(base, followlinks=False):
                rel = os.path.relpath(dirpath, self.root)
                rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
                dirnames[:] = [d for d in dirnames
                               if not os.path.islink(os.path.join(dirpath, d))
                               and ((rel + d + "/").startswith(prefix) or prefix.startswith(rel + d + "/"))]
                for name in filenames:
                    key = rel + name
                    if not key.startswith(prefix):
                        continue
                    full = os.path.join(dirpath, name)
                    try:
                        st = os.lstat(full)
                    except FileNotFoundError:
                        continue
                    if not os.path.isfile(full) or os.path.islink(full):
                        continue
                    try:
                        check_key(key)
                    except UnsafeKeyError:
                        continue
                    out[key] = st.st_size
        except OSError as e:
            raise self._error("list", prefix, e) from e
        return dict(sorted(out.items()))

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            try:
                os.unlink(path)
            except FileNotFoundError:
                return
            fsync_dir(path.parent)
            # Remove directories this deletion left empty (never the root, never a non-empty one).
            d = path.parent
            while d != self.root and self.root in d.parents:
                try:
                    os.rmdir(d)
                except OSError:
                    break
                fsync_dir(d.parent)
                d = d.parent
        except OSError as e:
            raise self._error("delete", key, e) from e

    def exists(self, key: str) -> bool:
        path = self._path(key)
        return path.is_file() and not path.is_symlink()
