"""Weights-only export (MindFormers' ``checkpoint_network``): model parameters as a plain
PyTorch ``state_dict`` file, for inference or fine-tuning without memckpt.

    export_weights(manifest, "model.safetensors", store=store)       # a persisted step
    with ckpt.engine.reading(step) as shard:                          # an in-RAM step
        export_weights(shard, "model.pt", fmt="pt")

The source is verified first (checksums) and nothing is unpickled. The model
tensors are those :class:`~memckpt.TrainState` names ``model/<name>/<key>``
(tied weights stored once come back under every name, from the header's
``aliases``). With one model the keys are its own ``state_dict`` keys; with
several, ``<name>.<key>``. For a rank-sharded job the parameters in rank 0's
shard are the full model (DDP replicates them; ZeRO shards only the optimizer),
so a manifest is exported from rank 0.

``fmt="safetensors"`` loads with ``safetensors.torch.load_file``; ``fmt="pt"``
with ``torch.load(path, weights_only=True)``. The file is written atomically
(temporary name, fsync, rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Union

import numpy as np

from memckpt import shard as shardfmt
from memckpt.errors import ChecksumError, StateError
from memckpt.fsutil import replace_atomic
from memckpt.persist.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from memckpt.persist.catalog import CheckpointStore

ShardSource = Union[shardfmt.Shard, np.ndarray, bytes, bytearray, memoryview, str, os.PathLike, Manifest]
FORMATS = ("safetensors", "pt")


def _open(source: ShardSource, store: Optional["CheckpointStore"]) -> tuple[shardfmt.Shard, str]:
    if isinstance(source, shardfmt.Shard):
        return source, "shard"
    if isinstance(source, Manifest):
        if store is None:
            raise StateError("export_weights(manifest, ...) needs store=<the CheckpointStore it came "
                             "from> to read rank 0's shard")
        region = store.read_shard(source, 0)
        name = f"{store.describe()}/{source.shard(0).key}"
        return shardfmt.open_shard(region, name, verify=False), name  # read_shard verified it
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            region = np.fromfile(path, dtype=np.uint8)
        except OSError as e:
            raise ChecksumError(f"{path}: cannot read it as a shard: {e.strerror or e}") from None
        return shardfmt.open_shard(region, str(path), verify=True), str(path)
    if isinstance(source, (bytes, memoryview)):
        region = np.frombuffer(source, dtype=np.uint8).copy()  # writable, owned
    elif isinstance(source, bytearray):
        region = np.frombuffer(source, dtype=np.uint8)
    elif isinstance(source, np.ndarray):
        region = source.reshape(-1).view(np.uint8)
        if not region.flags.writeable:
            region = region.copy()
    else:
        raise StateError(f"export_weights cannot read a {type(source).__name__}: pass shard bytes, "
                         "a memckpt.shard.Shard, a shard file path, or a Manifest with its store")
    return shardfmt.open_shard(region, "shard", verify=True), "shard"


def weights_from_shard(shard: shardfmt.Shard, model: Optional[str] = None,
                       source: str = "shard") -> dict[str, torch.Tensor]:
    """The model ``state_dict`` stored in a (verified) shard, as tensors that own their memory.

    ``model``: export only this model of the TrainState (its keys unprefixed);
    default all models, prefixed ``<name>.`` when there are several. Tied
    weights share one tensor.
    """
    meta = shard.meta
    models = meta.get("models")
    if not isinstance(models, dict) or not models:
        raise StateError(f"{source} holds no TrainState models (header meta 'models' is missing)")
    names = list(models) if model is None else [model]
    if model is not None and model not in models:
        raise StateError(f"{source} has no model {model!r}; it holds {', '.join(models)}")
    aliases = meta.get("aliases", {}) or {}
    prefix = len(names) > 1
    copies: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for mname in names:
        for key in models[mname]:
            name = f"model/{mname}/{key}"
            target = aliases.get(name, name)
            if target not in shard.tensors:
                raise StateError(f"{source}: tensor {name!r} (stored as {target!r}) is missing")
            if target not in copies:
                copies[target] = shard.tensors[target].clone()
            out[f"{mname}.{key}" if prefix else key] = copies[target]
    return out


def export_weights(source: ShardSource, out_path: str | os.PathLike, fmt: str = "safetensors", *,
                   store: Optional["CheckpointStore"] = None, model: Optional[str] = None
                   ) -> list[str]:
    """Write the model weights of ``source`` to ``out_path``; returns the exported keys.

    ``source``: raw shard bytes (``bytes`` / ``np.ndarray`` / ``memoryview``),
    an opened :class:`memckpt.shard.Shard` (e.g. ``ckpt.engine.reading(step)``),
    the path of a shard file (``Checkpointer.save``), or a persisted
    :class:`Manifest` together with ``store`` (rank 0's shard is read and verified).
    """
    if fmt not in FORMATS:
        raise StateError(f"fmt={fmt!r} is invalid: choose one of {', '.join(FORMATS)}")
    shard, name = _open(source, store)
    weights = weights_from_shard(shard, model, name)
    out = Path(out_path)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        # safetensors refuses shared storage: tied weights are written as separate copies.
        seen: set[int] = set()
        plain = {}
        for k, t in weights.items():
            plain[k] = t.clone() if id(t) in seen else t
            seen.add(id(t))
        metadata = {"format": "pt", "memckpt_step": str(shard.step)}
        replace_atomic(out, lambda p: save_file(plain, str(p), metadata=metadata))
    else:
        import torch
        replace_atomic(out, lambda p: torch.save(weights, p))
    return list(weights)
