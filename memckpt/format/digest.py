"""A deterministic hash of a training state's parameters and optimizer state."""

from __future__ import annotations

import hashlib

import torch

from memckpt.format.shard import dtype_name
from memckpt.format.state import TrainState


def state_digest(state: TrainState) -> str:
    """sha256 over every model tensor and optimizer-state tensor, by name.

    Equal digests across processes mean bit-identical parameters and optimizer
    moments; RNG and data position are not included. A DTensor (FSDP2, tensor
    parallel) counts as this rank's local chunk and where it sits in the global tensor:
    the digest is per rank and needs no collective; compare every rank's.
    """
    h = hashlib.sha256()
    captured = state.capture(step=0)
    layouts = captured.meta["dtensors"]
    for name, t in sorted(captured.tensors, key=lambda nt: nt[0]):
        if not name.startswith(("model/", "optim/")):
            continue
        t = t.detach().cpu().contiguous()
        where = layouts.get(name)
        where = f"{where['global_shape']}@{where['offsets']}|" if where else ""
        h.update(f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}|{where}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
