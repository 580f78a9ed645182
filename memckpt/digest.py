"""A deterministic hash of a training state's parameters and optimizer state."""

from __future__ import annotations

import hashlib

import torch

from memckpt.shard import dtype_name
from memckpt.state import TrainState


def state_digest(state: TrainState) -> str:
    """sha256 over every model tensor and optimizer-state tensor, by name.

    Equal digests across processes mean bit-identical parameters and optimizer
    moments; RNG and data position are not included.
    """
    h = hashlib.sha256()
    captured = state.capture(step=0)
    for name, t in sorted(captured.tensors, key=lambda nt: nt[0]):
        if not name.startswith(("model/", "optim/")):
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{name}|{dtype_name(t.dtype)}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
