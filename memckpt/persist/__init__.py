"""The persistence tier: storage backends, manifests, the per-tier checkpoint store, export.

Nothing here imports Ray. See :mod:`memckpt.persist.store` for the guarantees.
"""

from memckpt.persist.backend import (LocalBackend, S3Backend, StorageBackend, check_key,
                                     open_backend)
from memckpt.persist.errors import (ManifestError, ObjectNotFoundError, PersistError,
                                    UnsafeKeyError)
from memckpt.persist.export import export_weights, weights_from_shard
from memckpt.persist.manifest import Manifest, ShardEntry
from memckpt.persist.store import CheckpointInfo, CheckpointStore, find_latest

__all__ = [
    "CheckpointInfo", "CheckpointStore", "LocalBackend", "Manifest", "ManifestError",
    "ObjectNotFoundError", "PersistError", "S3Backend", "ShardEntry", "StorageBackend",
    "UnsafeKeyError", "check_key", "export_weights", "find_latest", "open_backend",
    "weights_from_shard",
]
