"""The RAM copies of a running job as a :class:`~memckpt.format.dcp_reader.ShardSource`: the
replica stores holding a committed step serve byte ranges of each shard
(:meth:`memckpt.runtime.wire.data_plane.StoreConnection.fetch_range`), so a restore into
another world size or layout reads only what overlaps its new chunks."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from memckpt.format.dcp_reader import ShardSource
from memckpt.errors import MemckptError, NoSnapshotError
from memckpt.runtime.wire.data_plane import StoreConnection


class ReplicaSource(ShardSource):
    """Step ``step`` of a job of ``world_size`` ranks, rank r's shard held by the stores at
    ``holders[r]`` (addresses, tried in turn: a store that fails is skipped)."""

    def __init__(self, holders: Mapping[int, Sequence[tuple[str, int]]], world_size: int,
                 step: int, timeout_s: float = 120.0) -> None:
        super().__init__(world_size, step)
        missing = [r for r in range(world_size) if not holders.get(r)]
        if missing:
            raise NoSnapshotError(f"no store holds the shards of ranks {missing} at step {step}")
        # (host, port) pairs, as tuples (a list from JSON cannot key a dict)
        self.holders = {r: [(a[0], a[1]) for a in holders[r]] for r in range(world_size)}
        self.timeout_s = timeout_s
        self._conns: dict[tuple[str, int], StoreConnection] = {}

    def _conn(self, address: tuple[str, int]) -> StoreConnection:
        if address not in self._conns:
            self._conns[address] = StoreConnection(address, self.timeout_s)
        return self._conns[address]

    def read(self, rank: int, offset: int, length: int) -> np.ndarray:
        errors = []
        for address in self.holders[rank]:
            try:
                return self._conn(address).fetch_range(rank, self.step, offset, length)
            except (MemckptError, OSError) as e:
                conn = self._conns.pop(address, None)
                if conn is not None:  # its stream may be mid-reply: never reuse it
                    conn.close()
                errors.append(f"{address[0]}:{address[1]}: {e}")
        raise NoSnapshotError(f"no store served rank {rank}'s shard of step {self.step}: "
                              + "; ".join(errors))

    def describe(self, rank: int) -> str:
        host, port = self.holders[rank][0]
        return f"ram://{host}:{port}/rank{rank}@{self.step}"

    def close(self) -> None:
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
