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
- every OS / boto3 failure is raised as :class:`~memckpt.errors.PersistError`
  (``retryable`` for connection problems, timeouts, S3 5xx and throttling);
  a missing key as :class:`~memckpt.errors.ObjectNotFoundError`.
  Messages name the URI and what to check; they never carry credentials.

``open_backend(uri)`` picks the backend: ``s3://bucket/prefix`` is S3, a plain
path (or ``file://``) is a local directory. S3 credentials and region come from
the standard AWS chain (environment, profile, instance/pod role); the endpoint
from ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` (read by boto3 itself) or
``MEMCKPT_S3_ENDPOINT_URL``.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import time
from typing import Any, Iterable, Optional, Union
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from memckpt.errors import PersistError, UnsafeKeyError

log = logging.getLogger("memckpt.persist")

Data = Union[bytes, bytearray, memoryview, np.ndarray]

MAX_KEY_LEN = 1024  # S3's limit, in UTF-8 bytes
CHUNK = 64 << 20  # local read/write chunk
MiB = 1 << 20

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DRIVE = re.compile(r"^[A-Za-z]:")
# A local put's temporary file: ".<name>.tmp-<pid>-<8 hex>" next to the final name.
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.tmp-\d+-[0-9a-f]{8}$")


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


def check_range(offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise PersistError(f"byte range offset={offset}, length={length} is invalid: both must be >= 0")


def as_bytes_view(data: Data) -> memoryview:
    if isinstance(data, np.ndarray):
        if not data.flags.c_contiguous:
            data = np.ascontiguousarray(data)
        return memoryview(data.reshape(-1).view(np.uint8))
    view = memoryview(data)
    if not view.c_contiguous:
        raise PersistError("put() needs contiguous bytes; pass bytes, a contiguous memoryview or "
                           "a numpy array")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def sanitize_url(url: Optional[str]) -> Optional[str]:
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


def scrub(text: str) -> str:
    """Remove any credential value from the environment that a message might echo."""
    for var in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
                "AWS_SECURITY_TOKEN"):
        value = os.environ.get(var)
        if value and len(value) >= 4 and value in text:
            text = text.replace(value, "<redacted>")
    return text


# -- interface --------------------------------------------------------------------------------
class StorageBackend(abc.ABC):
    """Objects under string keys relative to one root. Thread-safe; see the module docstring.

    ``last_progress`` is the ``time.monotonic()`` of the last request answered or bytes
    moved (0.0 before any): a waiter tells a slow transfer from a hung one by it.
    """

    last_progress: float = 0.0

    def progressed(self) -> None:
        """Record that storage answered or moved bytes just now."""
        self.last_progress = time.monotonic()

    def location(self) -> str:
        """Where the tier is, for messages: the root, and for a remote store its endpoint."""
        return self.describe()

    def prepare(self) -> None:
        """Set up what the first request needs, before training starts (no request is sent;
        an error is left for the first request to report, as any storage error)."""
        return None  # a local folder needs nothing

    @abc.abstractmethod
    def put(self, key: str, data: Data) -> None:
        """Store ``data`` under ``key`` atomically (replacing any previous object)."""

    @abc.abstractmethod
    def get(self, key: str) -> np.ndarray:
        """The object's bytes as a new, writable 1-D ``uint8`` array.

        Raises :class:`ObjectNotFoundError` when the key does not exist.
        """

    def get_range(self, key: str, offset: int, length: int) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of the object as a new 1-D ``uint8`` array
        (shorter only if the object ends first). Backends read just that range; this
        default reads the whole object."""
        check_range(offset, length)
        return self.get(key)[offset: offset + length].copy()

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

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release threads and connections (the backend stays usable: they are re-created)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()!r})"
