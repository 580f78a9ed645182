"""The persistence tier: storage backends, manifests, the per-tier checkpoint store, export.

Nothing here imports Ray. See :mod:`memckpt.persist.catalog` for the guarantees.
"""

from memckpt.persist.backend import StorageBackend, check_key
from memckpt.persist.catalog import CheckpointInfo, CheckpointStore, find_latest
from memckpt.errors import (
                                    ManifestError,
                                    ObjectNotFoundError,
                                    PersistError,
                                    UnsafeKeyError,
)
from memckpt.persist.export import export_weights, weights_from_shard
from memckpt.persist.local import LocalBackend
from memckpt.persist.manifest import Manifest, ShardEntry
from memckpt.persist.s3 import S3Backend
from memckpt.persist.uri import open_backend

__all__ = [
    "CheckpointInfo", "CheckpointStore", "LocalBackend", "Manifest", "ManifestError",
    "ObjectNotFoundError", "PersistError", "S3Backend", "ShardEntry", "StorageBackend",
    "UnsafeKeyError", "check_key", "export_weights", "find_latest", "open_backend",
    "weights_from_shard",
]
