"""Storage backends behind one small interface: a local directory and S3.

A backend stores opaque objects under string keys relative to its root
(``step-0000000100/rank-00000.shard``). Guarantees of every backend:

- ``put`` is atomic per object: a reader sees the old object, no object, or the
  whole new one, never a torn write. On a local disk the bytes go to a
  temporary name in the same directory, are fsynced, renamed over the key and
  the directory is fsynced (new directories are fsynced into their parents
  too), so a completed ``put`` survives a power cut. On S3 an object appears
  whole when its (multipart) upload completes.
- every key is checked before use (:func:`check_key`): no absolute paths, no
  ``..`` or ``.`` components, no backslashes, no empty components, no control
  characters. A local backend also refuses a key whose directory resolves
  (through symlinks) outside its root. Nothing is read, written or deleted
  outside the root.
- every OS / boto3 failure is raised as :class:`~memckpt.persist.errors.PersistError`
  (``retryable`` for connection problems, timeouts, S3 5xx and throttling);
  a missing key as :class:`~memckpt.persist.errors.ObjectNotFoundError`.
  Messages name the URI and what to check; they never carry credentials.

``open_backend(uri)`` picks the backend: ``s3://bucket/prefix`` is S3, a plain
path (or ``file://``) is a local directory. S3 credentials and region come from
the standard AWS chain (environment, profile, instance/pod role); the endpoint
from ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` (read by boto3 itself) or
``MEMCKPT_S3_ENDPOINT_URL``.
"""

from __future__ import annotations

import abc
import errno
import io
import logging
import os
import re
import threading
from pathlib import Path
from typing import Any, Iterable, Optional, Union
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from memckpt.fsutil import fsync_dir, write_atomic
from memckpt.persist.errors import ObjectNotFoundError, PersistError, UnsafeKeyError

log = logging.getLogger("memckpt.persist")

Data = Union[bytes, bytearray, memoryview, np.ndarray]

MAX_KEY_LEN = 1024  # S3's limit, in UTF-8 bytes
CHUNK = 64 << 20  # local read/write chunk
MiB = 1 << 20

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DRIVE = re.compile(r"^[A-Za-z]:")
# A local put's temporary file: ".<name>.tmp-<pid>-<8 hex>" next to the final name.
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.tmp-\d+-[0-9a-f]{8}$")
_S3_URI = re.compile(r"^s3://([^/]+)/?(.*)$")
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


# -- keys -------------------------------------------------------------------------------------
def check_key(key: Any, what: str = "key") -> str:
    """Return ``key`` if it is a safe relative key that stays under a root, else raise.

    Rejects non-strings, empty keys, absolute paths (``/x``, ``C:x``), backslashes,
    empty components (``a//b``, trailing ``/``), ``.`` and ``..`` components and
    control characters, with :class:`UnsafeKeyError` saying which rule broke.
    """
    if not isinstance(key, str) or not key:
        raise UnsafeKeyError(f"{what} {key!r} is invalid: use a non-empty relative path like "
                             "'step-0000000100/rank-00000.shard'")
    problem = None
    if "\\" in key:
        problem = "contains a backslash"
    elif key.startswith("/") or _DRIVE.match(key):
        problem = "is an absolute path"
    elif _CONTROL.search(key):
        problem = "contains a control character"
    elif len(key.encode()) > MAX_KEY_LEN:
        problem = f"is longer than {MAX_KEY_LEN} bytes"
    else:
        for part in key.split("/"):
            if part == "":
                problem = "has an empty path component ('//' or a trailing '/')"
            elif part in (".", ".."):
                problem = f"has a '{part}' component"
            if problem:
                break
    if problem:
        raise UnsafeKeyError(f"{what} {key!r} {problem}: keys must stay under the checkpoint root "
                             "(relative, '/'-separated, no '..')")
    return key


def check_prefix(prefix: Any) -> str:
    """A listing prefix: ``""`` (everything) or a safe key, optionally ending in ``/``."""
    if prefix == "":
        return prefix
    if not isinstance(prefix, str):
        raise UnsafeKeyError(f"prefix {prefix!r} is not a string")
    check_key(prefix[:-1] if prefix.endswith("/") else prefix, "prefix")
    return prefix


def is_partial_name(name: str) -> bool:
    """True for the temporary name of a local ``put`` that never finished (a crash mid-write)."""
    return bool(_PARTIAL.match(name))


def partial_target(name: str) -> Optional[str]:
    """The final file name a temporary ``put`` name was meant for, or None."""
    m = _PARTIAL.match(name)
    return m.group("name") if m else None


def _as_bytes_view(data: Data) -> memoryview:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return memoryview(data.reshape(-1).view(np.uint8))
    view = memoryview(data)
    if not view.c_contiguous:
        raise PersistError("put() needs contiguous bytes; pass bytes, a contiguous memoryview or "
                           "a numpy array")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _sanitize_url(url: Optional[str]) -> Optional[str]:
    """Drop any user:password@ from an endpoint URL before it appears in a message."""
    if not url:
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable endpoint URL>"
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host = f"{host}:{parts.port}"
        return urlunsplit((parts.scheme, host, parts.path, parts.query, parts.fragment))
    return url


def _scrub(text: str) -> str:
    """Remove any credential value from the environment that a message might echo."""
    for var in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
                "AWS_SECURITY_TOKEN"):
        value = os.environ.get(var)
        if value and len(value) >= 4 and value in text:
            text = text.replace(value, "<redacted>")
    return text


# -- interface --------------------------------------------------------------------------------
class StorageBackend(abc.ABC):
    """Objects under string keys relative to one root. Thread-safe; see the module docstring."""

    @abc.abstractmethod
    def put(self, key: str, data: Data) -> None:
        """Store ``data`` under ``key`` atomically (replacing any previous object)."""

    @abc.abstractmethod
    def get(self, key: str) -> np.ndarray:
        """The object's bytes as a new, writable 1-D ``uint8`` array.

        Raises :class:`ObjectNotFoundError` when the key does not exist.
        """

    @abc.abstractmethod
    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        """``{key: size}`` of every object whose key starts with ``prefix``, keys relative to the root.

        Keys that are not safe (:func:`check_key`), e.g. written by another tool, are left out.
        """

    def list(self, prefix: str = "") -> list[str]:
        """Sorted keys (relative to the root) of every object whose key starts with ``prefix``."""
        return sorted(self.list_sizes(prefix))

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove ``key``; a missing key is not an error."""

    def delete_many(self, keys: Iterable[str]) -> None:
        """Remove several keys (in the order given on a local disk; batched on S3)."""
        for key in keys:
            self.delete(key)

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """True if an object is stored under ``key``."""

    @abc.abstractmethod
    def describe(self) -> str:
        """The root as a URI or path, for messages. Never contains credentials."""

    def close(self) -> None:
        """Release threads and connections (the backend stays usable: they are re-created)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"


# -- local filesystem -------------------------------------------------------------------------
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
            write_atomic(path, _as_bytes_view(data), mkdirs=self._mkdirs)
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


# -- S3 ---------------------------------------------------------------------------------------
class _MemoryFile(io.RawIOBase):
    """A seekable file over a memoryview of bytes (no copy)."""

    def __init__(self, buf: memoryview) -> None:
        super().__init__()
        self._buf, self._pos = buf, 0

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._buf)}[whence]
        self._pos = max(0, base + offset)
        return self._pos


class _Reader(_MemoryFile):
    """Read-only, for boto3 uploads."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        n = max(0, min(len(out), len(self._buf) - self._pos))
        out[:n] = self._buf[self._pos: self._pos + n]
        self._pos += n
        return n


class _Writer(_MemoryFile):
    """Writing into a preallocated uint8 array, for boto3 downloads."""

    def __init__(self, out: np.ndarray) -> None:
        super().__init__(memoryview(out))
        self.written = 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        data = memoryview(b).cast("B")
        end = self._pos + len(data)
        if end > len(self._buf):
            raise OSError(errno.EFBIG, "the object grew while it was downloaded")
        self._buf[self._pos: end] = data
        self._pos = end
        self.written += len(data)
        return len(data)


_RETRYABLE_CODES = {"SlowDown", "RequestTimeout", "RequestTimeoutException", "Throttling",
                    "ThrottlingException", "InternalError", "ServiceUnavailable",
                    "RequestLimitExceeded", "BandwidthLimitExceeded", "503", "500"}
_AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
               "InvalidToken", "TokenRefreshRequired", "AllAccessDisabled", "403"}
_MISSING_CODES = {"NoSuchKey", "NotFound", "404"}


class S3Backend(StorageBackend):
    """Objects under ``s3://bucket/prefix`` (S3 or any S3-compatible endpoint).

    Large objects are uploaded and downloaded in parallel parts (boto3's
    transfer manager): above ``multipart_threshold`` bytes, in parts of
    ``multipart_chunksize`` (at least 5 MiB, S3's minimum), ``max_concurrency``
    at a time. botocore retries transient errors ``max_attempts`` times before a
    :class:`PersistError` is raised. The backend can be pickled (to a Ray actor):
    the client is re-created on first use.
    """

    def __init__(self, uri: str, *, endpoint_url: Optional[str] = None, region: Optional[str] = None,
                 multipart_threshold: int = 64 * MiB, multipart_chunksize: int = 16 * MiB,
                 max_concurrency: int = 8, max_attempts: int = 3, connect_timeout: float = 10.0,
                 read_timeout: float = 120.0) -> None:
        m = _S3_URI.match(uri) if isinstance(uri, str) else None
        if not m or not _S3_BUCKET.match(m.group(1)) or ".." in m.group(1):
            raise PersistError(f"{uri!r} is not a valid S3 URI: write s3://bucket/prefix with a bucket "
                               "name of 3-63 lowercase letters, digits, dots or hyphens")
        self.bucket = m.group(1)
        prefix = m.group(2).strip("/")
        if prefix:
            check_key(prefix, "S3 prefix")
        self.prefix = prefix + "/" if prefix else ""
        self.uri = f"s3://{self.bucket}/{prefix}" if prefix else f"s3://{self.bucket}"
        self._endpoint_arg = endpoint_url or os.environ.get("MEMCKPT_S3_ENDPOINT_URL") or None
        self.region = region
        self.multipart_threshold = int(multipart_threshold)
        self.multipart_chunksize = max(int(multipart_chunksize), 5 * MiB)
        self.max_concurrency = int(max_concurrency)
        self.max_attempts = int(max_attempts)
        self.connect_timeout, self.read_timeout = float(connect_timeout), float(read_timeout)
        self._lock = threading.Lock()
        self._client: Any = None
        self._manager: Any = None

    # pickling: ship the settings, not the client or its thread pools
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_lock=None, _client=None, _manager=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def describe(self) -> str:
        return self.uri

    @property
    def endpoint(self) -> str:
        """The endpoint in use (without any user:password), for messages."""
        if self._client is not None:
            return _sanitize_url(self._client.meta.endpoint_url) or "AWS S3"
        url = (self._endpoint_arg or os.environ.get("AWS_ENDPOINT_URL_S3")
               or os.environ.get("AWS_ENDPOINT_URL"))
        return _sanitize_url(url) or "AWS S3"

    def _s3(self) -> tuple[Any, Any]:
        with self._lock:
            if self._client is None:
                import boto3
                from boto3.s3.transfer import TransferConfig, create_transfer_manager
                from botocore.config import Config as BotoConfig

                custom = (self._endpoint_arg or os.environ.get("AWS_ENDPOINT_URL_S3")
                          or os.environ.get("AWS_ENDPOINT_URL"))
                cfg = BotoConfig(
                    retries={"max_attempts": self.max_attempts, "mode": "standard"},
                    connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                    max_pool_connections=max(10, 2 * self.max_concurrency),
                    # S3-compatible endpoints (MinIO, moto, Ceph) want path-style addressing.
                    s3={"addressing_style": "path"} if custom else None)
                session = boto3.session.Session(region_name=self.region)
                try:
                    self._client = session.client("s3", endpoint_url=self._endpoint_arg, config=cfg)
                except Exception as e:  # bad endpoint URL, unknown region...
                    raise PersistError(f"cannot create an S3 client for {self.uri}: {_scrub(str(e))}: "
                                       "check the endpoint URL (AWS_ENDPOINT_URL / "
                                       "MEMCKPT_S3_ENDPOINT_URL) and the region (AWS_DEFAULT_REGION)",
                                       uri=self.uri) from None
                self._manager = create_transfer_manager(self._client, TransferConfig(
                    multipart_threshold=self.multipart_threshold,
                    multipart_chunksize=self.multipart_chunksize,
                    max_concurrency=self.max_concurrency, use_threads=True,
                    preferred_transfer_client="classic"))
            return self._client, self._manager

    def close(self) -> None:
        with self._lock:
            if self._manager is not None:
                self._manager.shutdown()
            self._client = self._manager = None

    def _full(self, key: str) -> str:
        return self.prefix + check_key(key)

    def _error(self, op: str, key: str, e: BaseException) -> PersistError:
        from botocore import exceptions as bx

        where = f"{op} {self.uri}/{key}" if key else f"{op} {self.uri}"
        ep = self.endpoint
        if isinstance(e, PersistError):
            return e
        if isinstance(e, (bx.NoCredentialsError, bx.PartialCredentialsError,
                          bx.CredentialRetrievalError, bx.UnknownCredentialError)):
            return PersistError(f"{where} failed: no usable AWS credentials ({type(e).__name__}): set "
                                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or "
                                "give the node an instance / pod role", uri=self.uri)
        streaming = tuple(getattr(bx, n) for n in ("IncompleteReadError", "ResponseStreamingError")
                          if hasattr(bx, n))
        if isinstance(e, (bx.ConnectionError, bx.HTTPClientError) + streaming):
            return PersistError(f"{where} failed: cannot reach the S3 endpoint {ep} "
                                f"({type(e).__name__}): check that it is up and reachable from this "
                                "node and that AWS_ENDPOINT_URL / MEMCKPT_S3_ENDPOINT_URL is right",
                                retryable=True, uri=self.uri)
        if isinstance(e, bx.ClientError):
            err = e.response.get("Error", {}) if isinstance(e.response, dict) else {}
            code = str(err.get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            detail = _scrub(str(err.get("Message", "")) or code)
            if code == "NoSuchBucket":
                return PersistError(f"{where} failed: bucket {self.bucket!r} does not exist at {ep}: "
                                    "create it or fix the URI / endpoint", uri=self.uri)
            if code in _MISSING_CODES or (status == 404 and code != "NoSuchUpload"):
                return ObjectNotFoundError(f"{self.uri}/{key} does not exist", uri=self.uri)
            if code in _AUTH_CODES or status == 403:
                return PersistError(f"{where} failed: access denied ({code}: {detail}): check the "
                                    "credentials (AWS_ACCESS_KEY_ID / AWS_PROFILE / role), that they "
                                    f"may read, write, list and delete in bucket {self.bucket!r}, "
                                    f"and the endpoint {ep}", uri=self.uri)
            if code in _RETRYABLE_CODES or status >= 500 or status == 429:
                return PersistError(f"{where} failed: the S3 endpoint {ep} answered {status or ''} "
                                    f"{code}: {detail} (transient; retry later)", retryable=True,
                                    uri=self.uri)
            return PersistError(f"{where} failed: {code or status}: {detail}: check the bucket "
                                f"{self.bucket!r}, the endpoint {ep} and the credentials",
                                uri=self.uri)
        try:
            from s3transfer.exceptions import RetriesExceededError
            if isinstance(e, RetriesExceededError):
                return PersistError(f"{where} failed: the download kept breaking off "
                                    f"({_scrub(str(e))}): check the network to {ep}",
                                    retryable=True, uri=self.uri)
        except ImportError:  # pragma: no cover
            pass
        if isinstance(e, bx.BotoCoreError):
            return PersistError(f"{where} failed: {type(e).__name__}: {_scrub(str(e))}: check the "
                                f"endpoint {ep}, the region and the credentials", uri=self.uri)
        if isinstance(e, OSError):
            return PersistError(f"{where} failed: {type(e).__name__}: {_scrub(str(e))}",
                                retryable=True, uri=self.uri)
        return PersistError(f"{where} failed: {type(e).__name__}: {_scrub(str(e))}", uri=self.uri)

    def put(self, key: str, data: Data) -> None:
        full = self._full(key)
        view = _as_bytes_view(data)
        try:
            _, manager = self._s3()
            manager.upload(_Reader(view), self.bucket, full).result()
        except Exception as e:
            raise self._error("put", key, e) from e

    def get(self, key: str) -> np.ndarray:
        full = self._full(key)
        try:
            client, manager = self._s3()
            resp = client.get_object(Bucket=self.bucket, Key=full)
            size = int(resp["ContentLength"])
            out = np.empty(size, dtype=np.uint8)
            writer = _Writer(out)
            if size <= self.multipart_threshold:  # one request: stream the body into the array
                body = resp["Body"]
                try:
                    while writer.written < size:
                        chunk = body.read(min(CHUNK, size - writer.written))
                        if not chunk:
                            break
                        writer.write(chunk)
                finally:
                    body.close()
            else:  # large: parallel ranged GETs through the transfer manager
                resp["Body"].close()
                from s3transfer.subscribers import BaseSubscriber

                class _Size(BaseSubscriber):
                    def on_queued(self, future: Any, **kwargs: Any) -> None:
                        future.meta.provide_transfer_size(size)

                manager.download(self.bucket, full, writer, subscribers=[_Size()]).result()
        except Exception as e:
            raise self._error("get", key, e) from e
        if writer.written != size:
            raise PersistError(f"get {self.uri}/{key}: received {writer.written} of {size} bytes "
                               "(the object changed while it was read)", retryable=True, uri=self.uri)
        return out

    def list_sizes(self, prefix: str = "") -> dict[str, int]:
        check_prefix(prefix)
        out: dict[str, int] = {}
        try:
            client, _ = self._s3()
            pages = client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix + prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    key = obj["Key"][len(self.prefix):]
                    try:
                        check_key(key)
                    except UnsafeKeyError:
                        continue  # "folder" markers and keys other tools wrote
                    out[key] = int(obj["Size"])
        except Exception as e:
            raise self._error("list", prefix, e) from e
        return dict(sorted(out.items()))

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            client, _ = self._s3()
            client.delete_object(Bucket=self.bucket, Key=full)
        except Exception as e:
            err = self._error("delete", key, e)
            if isinstance(err, ObjectNotFoundError):
                return
            raise err from e

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = [self._full(k) for k in keys]
        try:
            client, _ = self._s3()
            for i in range(0, len(keys), 1000):
                resp = client.delete_objects(Bucket=self.bucket, Delete={
                    "Objects": [{"Key": k} for k in keys[i: i + 1000]], "Quiet": True})
                errors = [x for x in resp.get("Errors", ()) if x.get("Code") != "NoSuchKey"]
                if errors:
                    first = errors[0]
                    raise PersistError(
                        f"delete under {self.uri} failed for {len(errors)} keys, first "
                        f"{first.get('Key', '')[len(self.prefix):]!r}: {first.get('Code')}: "
                        f"{_scrub(str(first.get('Message', '')))}",
                        retryable=first.get("Code") in _RETRYABLE_CODES, uri=self.uri)
        except Exception as e:
            raise self._error("delete", "", e) from e

    def exists(self, key: str) -> bool:
        full = self._full(key)
        try:
            client, _ = self._s3()
            client.head_object(Bucket=self.bucket, Key=full)
            return True
        except Exception as e:
            err = self._error("exists", key, e)
            if isinstance(err, ObjectNotFoundError):
                return False
            raise err from e


def open_backend(uri: str | os.PathLike[str], **s3_options: Any) -> StorageBackend:
    """The backend for ``uri``: ``s3://bucket/prefix`` → :class:`S3Backend` (``s3_options`` go
    to it), a local path or ``file:///path`` → :class:`LocalBackend`."""
    text = os.fspath(uri)
    if not isinstance(text, str) or not text.strip():
        raise PersistError(f"storage URI {uri!r} is empty: give a directory or s3://bucket/prefix")
    if text.startswith("s3://"):
        return S3Backend(text, **s3_options)
    if text.startswith("file://"):
        text = text[len("file://"):]
    elif "://" in text:
        raise PersistError(f"storage URI {text!r} has an unsupported scheme: use a local path or "
                           "s3://bucket/prefix")
    return LocalBackend(text)
