"""One exception root for memckpt.

Every error memckpt raises derives from :class:`MemckptError`. Each kind says
whether retrying can help (``retryable``). All of them survive pickling, so an
error raised inside a Ray actor arrives at the driver as the same type with the
same message. Messages name the setting or action that fixes the problem.
"""

from __future__ import annotations

from typing import Any, Optional


class MemckptError(Exception):
    """Root of every error memckpt raises."""

    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:  # keep the type and message across processes
        return (type(self), (self.message,))


class ConfigError(MemckptError, ValueError):
    """A configuration value is invalid; the message names field, value and fix."""


class PlacementError(MemckptError):
    """Replica placement cannot be satisfied by the nodes at hand."""


class StateError(MemckptError):
    """Training state cannot be captured or restored (missing/unexpected keys, bad types)."""


class IncompatibleCheckpointError(StateError):
    """A checkpoint of this job's tier holds another model (keys or shapes differ)."""


class ChecksumError(MemckptError):
    """A shard's bytes do not match its checksum, or its file is truncated or malformed."""


class NoSnapshotError(MemckptError):
    """There is no complete snapshot to restore from."""


class MemoryBudgetError(MemckptError):
    """The snapshot slots would not fit the host RAM memckpt may hold on a node
    (``Config.ram_budget``) or the shared-memory file system's room; raised before the first
    snapshot allocates anything, with the numbers and the settings that lower them."""


class FallBehindError(MemckptError):
    """Background copies could not keep up and the policy asked to fail."""

    retryable = True


class RecoveryError(MemckptError):
    """Recovery is impossible (every copy of some shard is lost, restarts exhausted)."""


class StaleGenerationError(MemckptError):
    """A replica write from a generation of workers that recovery has replaced."""


class SupersededPutError(MemckptError):
    """A replica transfer the store no longer accepts: never begun, finished, or superseded
    by a newer transfer of the same shard (one fenced off by recovery gets
    :class:`StaleGenerationError`)."""


class GenerationEnded(MemckptError):
    """Recovery replaced this group of workers: the training function must return."""


# ---- the persisted tier (disk, S3) ----------------------------------------------------------
# PersistError wraps every failure of a storage backend (an OS error on a local disk, a
# boto3/botocore error against S3). Its message names the storage URI and what to check and
# never contains a credential. ``retryable`` is True when trying again later can help (a
# connection refused or reset, a timeout, an S3 5xx or throttling reply), so a background
# persister can back off and retry while a configuration mistake (no credentials, no such
# bucket, a full or read-only disk) is reported at once.

class PersistError(MemckptError):
    """A storage backend failed; ``uri`` names the tier, ``retryable`` says if retrying can help."""

    def __init__(self, message: str, retryable: bool = False, uri: Optional[str] = None) -> None:
        super().__init__(message)
        self.retryable = bool(retryable)
        self.uri = uri

    def __reduce__(self) -> tuple[Any, ...]:  # keep the type, message and flags across processes (Ray)
        return (type(self), (self.message, self.retryable, self.uri))


class ObjectNotFoundError(PersistError):
    """The key does not exist in the backend (a missing shard or manifest)."""


class UnsafeKeyError(PersistError, ValueError):
    """A key (or a path inside a manifest) would leave the checkpoint root."""


class ManifestError(PersistError):
    """A manifest is missing fields, has wrongly typed values or names unsafe paths."""
