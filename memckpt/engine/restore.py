"""Loading a snapshot held in a slot: verified chunk by chunk while it loads.

The chunk digests are checked on the engine's hashing threads, in data order, from the
moment the restore starts; :class:`VerifiedViews` hands a tensor to the load only once
every chunk under it has verified, so no byte that failed its checksum ever reaches the
live state, while the tensors verified first are already being copied (to the GPU, at
bus speed from the pinned slot, see :func:`load_memory`) as the rest verify.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Iterator, Mapping, Optional, Sequence

import torch

from memckpt.engine.populate import FAULTED_IN, populated_clone
from memckpt.errors import ChecksumError
from memckpt.format import shard as fmt
from memckpt.format.state import LoadMemory, TrainState


def _hash_run(shard: fmt.Shard, chunks: fmt.Chunks, run: Sequence[int]) -> list[str]:
    return [fmt.chunk_checksum(shard, chunks, i) for i in run]


class VerifiedViews(Mapping[str, torch.Tensor]):
    """The tensors of ``shard`` (opened unverified), each returned only after the chunks
    holding it verified; raises :class:`ChecksumError` naming ``source`` otherwise.
    :meth:`finish` waits for every chunk (call it before the load counts as done)."""

    def __init__(self, shard: fmt.Shard, source: str, pool: cf.Executor) -> None:
        self.shard, self.source = shard, source
        chunks = shard.chunks
        if chunks is None:  # an old shard without chunk digests: the whole region first
            fmt.verify_data(shard, source)
            self._runs: list[tuple[Sequence[int], cf.Future]] = []
            self._run_len = 1
            return
        if shard.header.get("format", 1) >= 2 and \
                fmt.digest_of_chunks(chunks.digests) != shard.header["data_xxh3"]:
            raise ChecksumError(f"{source}: the chunk checksums disagree with the data "
                                "checksum: the shard is corrupt")
        self._chunks = chunks
        runs = fmt.batched(range(len(chunks.digests)))
        self._run_len = len(runs[0]) if runs else 1
        self._runs = [(run, pool.submit(_hash_run, shard, chunks, run)) for run in runs]
        self._verified: set[int] = set()
        self._entries = {e.name: e for e in shard.layout.entries}

    def _check(self, index: int) -> None:
        if index in self._verified:
            return
        run, future = self._runs[index]
        for i, got in zip(run, future.result()):
            if got != self._chunks.digests[i]:
                self.cancel()
                raise ChecksumError(f"{self.source}: data checksum mismatch in chunk {i} "
                                    f"(stored {self._chunks.digests[i]}, computed {got}): the "
                                    "shard is corrupt")
        self._verified.add(index)

    def __getitem__(self, name: str) -> torch.Tensor:
        view = self.shard.tensors[name]  # KeyError for a name the shard lacks
        if self._runs:
            e = self._entries[name]
            size = self._chunks.chunk_bytes * self._run_len
            last = e.offset + max(e.nbytes, 1) - 1
            for index in range(e.offset // size, last // size + 1):
                self._check(index)
        return view

    def __iter__(self) -> Iterator[str]:
        return iter(self.shard.tensors)

    def __len__(self) -> int:
        return len(self.shard.tensors)

    def finish(self) -> None:
        """Wait for every chunk's check; raises :class:`ChecksumError` on a mismatch."""
        for index in range(len(self._runs)):
            self._check(index)

    def cancel(self) -> None:
        for _, future in self._runs:
            future.cancel()


def state_device(state: TrainState) -> Optional[torch.device]:
    """The one device every optimized parameter lives on, or None (none, or mixed)."""
    devices = {p.device for opt in state.optimizers.values()
               for group in opt.param_groups for p in group["params"]}
    return devices.pop() if len(devices) == 1 else None


def load_memory(state: TrainState) -> LoadMemory:
    """How a restore's bytes land for ``state``. CPU: into memory faulted in before the
    copy (:data:`FAULTED_IN`). Every optimized parameter on CUDA: the optimizer state is
    handed to torch as the slot's (pinned) views, which torch copies straight to the
    parameters' device: no host clone, host-to-device at bus speed; 0-d values (Adam's
    ``step``, which torch keeps on the host and updates in place) are still cloned."""
    device = state_device(state)
    if device is None or device.type != "cuda":
        return FAULTED_IN

    def to_device_later(t: torch.Tensor) -> torch.Tensor:
        return t if t.dim() else populated_clone(t)
    return LoadMemory(before_copy=FAULTED_IN.before_copy, clone=FAULTED_IN.clone,
                      optimizer_clone=to_device_later)
