"""Which backend a storage URI names: ``s3://bucket/prefix`` or a local path."""

from __future__ import annotations

import os
from typing import Any

from memckpt.persist.backend import StorageBackend
from memckpt.errors import PersistError
from memckpt.persist.local import LocalBackend
from memckpt.persist.s3 import S3Backend


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
