"""A sampler whose position (epoch, index) is part of the checkpoint."""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Sampler

from memckpt.errors import StateError


class ResumableSampler(Sampler[int]):
    """Shuffles per epoch from ``seed + epoch`` and remembers how far it got.

    ``state_dict()`` is ``{"epoch", "index"}``: after a restore, iteration picks up
    at the next unseen sample of the same permutation. With ``rank``/``world_size``
    each rank sees its own slice (like ``DistributedSampler``). Exact with a
    ``DataLoader`` of ``num_workers=0``; worker processes prefetch ahead, so with
    them record the position the training loop has consumed instead. Give the
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
        self.index = 0  # samples of this epoch already handed out

    def _order(self) -> list[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.data_len, generator=g).tolist()
        else:
            order = list(range(self.data_len))
        per_rank = self.data_len // self.world_size
        return order[self.rank * per_rank: (self.rank + 1) * per_rank]

    def __len__(self) -> int:
        return self.data_len // self.world_size

    def __iter__(self) -> Iterator[int]:
        order = self._order()
        while self.index < len(order):
            i = order[self.index]
            self.index += 1
            yield i
        self.epoch += 1
        self.index = 0

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "data_len": self.data_len}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("data_len", self.data_len) != self.data_len:
            raise StateError(f"the snapshot's sampler covers {state['data_len']} samples, this one "
                             f"{self.data_len}: the dataset changed; set load.ignore_data_position")
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
