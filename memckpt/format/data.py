"""A sampler whose position (epoch, global samples consumed) is part of the checkpoint."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from memckpt.errors import StateError


class ResumableSampler(Sampler[int]):
    """Shuffles per epoch from ``seed + epoch`` and remembers how far the job got.

    The epoch's order is one permutation of the dataset, dealt to the ranks in turn:
    with ``rank``/``world_size`` W, the k-th sample of rank r is the order's sample at
    global position ``start + k * W + r`` (``start`` is 0 at an epoch's beginning).
    ``state_dict()`` records the global position, ``consumed`` (every rank draws the
    same number of samples per step), so a job restored with another world size M
    goes on from the same global position, dealing the rest of the epoch to its M ranks.

    The rule when the rest is not divisible by the world size: **no sample is
    repeated; at most M-1 are skipped**. Each rank takes ``(data_len - start) // M``
    samples, and the last ``(data_len - start) % M`` of the epoch's order are left
    out, as at the end of any epoch whose length is not a multiple of the world size.

    Exact with a ``DataLoader`` of ``num_workers=0``; worker processes prefetch ahead, so
    with them record the position the training loop has consumed instead. Give the
    ``DataLoader`` its own ``generator=torch.Generator()``: without one, every
    ``iter(loader)`` draws a seed from the global torch RNG, and a resumed process
    creates its iterator at a different point than the original run did, which
    shifts dropout and every other global-RNG draw after the restore.
    """

    def __init__(self, data_len: int, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        if data_len < 1 or not 0 <= rank < world_size:
            raise StateError(f"ResumableSampler needs data_len >= 1 and 0 <= rank < world_size; "
                             f"got data_len={data_len}, rank={rank}, world_size={world_size}")
        self.data_len, self.shuffle, self.seed = data_len, shuffle, seed
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.start = 0  # global position this rank's pass over the epoch began at
        self.index = 0  # samples this rank handed out since ``start``

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self.data_len, generator=g).tolist()
        return list(range(self.data_len))

    def __len__(self) -> int:
        return self.data_len // self.world_size

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        count = (self.data_len - self.start) // self.world_size
        while self.index < count:
            i = order[self.start + self.index * self.world_size + self.rank]
            self.index += 1
            yield i
        self.epoch += 1
        self.start = self.index = 0

    @property
    def consumed(self) -> int:
        """Samples of this epoch the whole job has consumed (all ranks together)."""
        return min(self.start + self.index * self.world_size, self.data_len)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "consumed": self.consumed,
                "world_size": self.world_size, "seed": self.seed, "data_len": self.data_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("data_len", self.data_len) != self.data_len:
            raise StateError(f"the snapshot's sampler covers {state['data_len']} samples, this one "
                             f"{self.data_len}: the dataset changed; set load.ignore_data_position")
        self.epoch, index = int(state["epoch"]), int(state["index"])
        if state.get("world_size", self.world_size) == self.world_size:  # exactly as it was
            self.index = index
            self.start = int(state.get("consumed", index * self.world_size)) - index * self.world_size
        else:  # another world size: deal the rest of the epoch from the global position
            self.start, self.index = int(state["consumed"]), 0


def batch_plan(global_batch: int, micro_batch: int, world_size: int) -> int:
    """Gradient-accumulation steps per optimizer step that keep ``global_batch`` samples per
    step at ``world_size`` ranks of ``micro_batch`` samples each, so the learning-rate
    schedule (per step) means the same at any size. Raises :class:`StateError` naming the
    sizes when ``global_batch`` is not a whole number of ``world_size x micro_batch``."""
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch),
                        ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise StateError(f"batch_plan: {name}={value!r} must be a whole number >= 1")
    per_step = world_size * micro_batch
    if global_batch % per_step:
        raise StateError(
            f"global batch {global_batch} is not a whole number of steps of {world_size} ranks "
            f"x micro batch {micro_batch} = {per_step} samples: choose a global batch divisible "
            f"by micro_batch x every world size the job may run at (workers.min_workers .. "
            f"num_workers), or a micro batch that divides it")
    return global_batch // per_step
