"""Errors of the persistence tier.

:class:`PersistError` wraps every failure of a storage backend (an OS error on
a local disk, a boto3/botocore error against S3). Its message names the
storage URI and what to check (path, permissions, disk space; endpoint,
credentials, bucket) and never contains a credential. ``retryable`` is True
when trying again later can help (a connection refused or reset, a timeout, an
S3 5xx or throttling reply), so a background persister can back off and retry
while a configuration mistake (no credentials, no such bucket, a full or
read-only disk) is reported at once.
"""

from __future__ import annotations

from typing import Optional

from memckpt.errors import MemckptError


class PersistError(MemckptError):
    """A storage backend failed; ``uri`` names the tier, ``retryable`` says if retrying can help."""

    def __init__(self, message: str, retryable: bool = False, uri: Optional[str] = None) -> None:
        super().__init__(message)
        self.retryable = bool(retryable)
        self.uri = uri

    def __reduce__(self):  # keep the type, message and flags across processes (Ray)
        return (type(self), (self.message, self.retryable, self.uri))


class ObjectNotFoundError(PersistError):
    """The key does not exist in the backend (a missing shard or manifest)."""


class UnsafeKeyError(PersistError, ValueError):
    """A key (or a path inside a manifest) would leave the checkpoint root."""


class ManifestError(PersistError):
    """A manifest is missing fields, has wrongly typed values or names unsafe paths."""
