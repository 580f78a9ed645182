"""A persisted checkpoint (local directory or S3) as a :class:`~memckpt.dcp_reader.ShardSource`:
each byte range is one ``pread`` on disk, one ranged GET on S3."""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from memckpt.format.dcp_reader import MemckptReader, ShardSource
from memckpt.errors import ChecksumError, NoSnapshotError
from memckpt.persist.catalog import CheckpointStore
from memckpt.persist.manifest import Manifest


class PersistedSource(ShardSource):
    """The shards of ``manifest`` in ``store``, checked against the manifest as they are read."""

    def __init__(self, store: CheckpointStore, manifest: Manifest) -> None:
        super().__init__(manifest.world_size, manifest.step)
        self.store, self.manifest = store, manifest

    def read(self, rank: int, offset: int, length: int) -> np.ndarray:
        return self.store.backend.get_range(self.manifest.shard(rank).key, offset, length)

    def describe(self, rank: int) -> str:
        return f"{self.store.describe()}/{self.manifest.shard(rank).key}"

    def check(self, rank: int, header: dict[str, Any]) -> None:
        e = self.manifest.shard(rank)
        if header.get("data_xxh3") != e.checksum:
            raise ChecksumError(f"{self.describe(rank)}: data checksum {header.get('data_xxh3')} "
                                f"differs from the manifest's {e.checksum} (the shard was replaced)")


def newest_manifest(store: CheckpointStore, step: Optional[int] = None) -> Manifest:
    """The newest complete checkpoint of ``store`` (or ``step``'s); raises NoSnapshotError."""
    infos = [i for i in store.list_checkpoints() if i.complete and i.manifest is not None]
    if step is not None:
        infos = [i for i in infos if i.step == step]
    if not infos:
        what = f"step {step}" if step is not None else "a complete checkpoint"
        have = ", ".join(str(i.step) for i in store.list_checkpoints() if i.complete) or "none"
        raise NoSnapshotError(f"{store.describe()} holds no {what} (complete steps: {have}): check "
                              "the path or URI and --step")
    manifest = infos[0].manifest
    assert manifest is not None  # filtered above
    return manifest


def open_reader(uri: str | os.PathLike[str], step: Optional[int] = None) -> MemckptReader:
    """A DCP reader over the newest (or ``step``'s) checkpoint under ``uri``."""
    store = CheckpointStore(os.fspath(uri))
    return MemckptReader(PersistedSource(store, newest_manifest(store, step)))
