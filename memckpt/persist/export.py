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
and a persisted checkpoint of any layout is assembled from every rank's chunks.

``fmt="safetensors"`` loads with ``safetensors.torch.load_file``; ``fmt="pt"``
with ``torch.load(path, weights_only=True)``. The file is written atomically
(temporary name, fsync, rename).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

from memckpt.format import shard as shardfmt
from memckpt.engine import shared_pages
from memckpt.errors import ChecksumError, MemckptError, StateError
from memckpt.util.fsutil import replace_atomic
from memckpt.persist.manifest import Manifest

if TYPE_CHECKING:
    import torch

    from memckpt.format.dcp_reader import MemckptReader
    from memckpt.persist.catalog import CheckpointStore

ShardSource = Union[shardfmt.Shard, np.ndarray, bytes, bytearray, memoryview, str, os.PathLike, Manifest]
FORMATS = ("safetensors", "pt")


def _open(source: ShardSource, store: Optional["CheckpointStore"]) -> tuple[shardfmt.Shard, str]:
    if isinstance(source, shardfmt.Shard):
        return source, "shard"
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        try:
            region = shared_pages.read_bytes(path)  # a RAM slot's shared pages included
        except (OSError, MemckptError) as e:
            why = (e.strerror if isinstance(e, OSError) else None) or e
            raise ChecksumError(f"{path}: cannot read it as a shard: {why}") from None
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
                         "a memckpt.format.shard.Shard, a shard file path, or a Manifest with its store")
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
    an opened :class:`memckpt.format.shard.Shard` (e.g. ``ckpt.engine.reading(step)``),
    the path of a shard file (``Checkpointer.save``), or a persisted
    :class:`Manifest` together with ``store`` (every rank's shards are read, and a sharded
    tensor, FSDP2 or TP, is assembled whole: see :func:`export_weights_sharded`).
    """
    if fmt not in FORMATS:
        raise StateError(f"fmt={fmt!r} is invalid: choose one of {', '.join(FORMATS)}")
    if isinstance(source, Manifest):  # every rank's shards, whatever their layout
        if store is None:
            raise StateError("export_weights(manifest, ...) needs store=<the CheckpointStore it "
                             "came from>")
        from memckpt.format.dcp_reader import MemckptReader
        from memckpt.persist.dcp_source import PersistedSource
        return export_weights_sharded(MemckptReader(PersistedSource(store, source)), out_path,
                                      fmt, model)
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


# -- sharded checkpoints (FSDP2, TP, ZeRO): assembled through the DCP reader --------------------
_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
                       "uint8": "U8", "bool": "BOOL", "float8_e4m3fn": "F8_E4M3",
                       "float8_e5m2": "F8_E5M2"}


def export_weights_sharded(reader: "MemckptReader", out_path: str | os.PathLike,
                           fmt: str = "safetensors", model: Optional[str] = None) -> list[str]:
    """Write the model weights of every rank's shards (any layout) to ``out_path``, each
    tensor assembled whole from its chunks. ``safetensors`` is written one tensor at a
    time (memory: the largest tensor and one chunk); ``pt`` holds them all at once."""
    if fmt not in FORMATS:
        raise StateError(f"fmt={fmt!r} is invalid: choose one of {', '.join(FORMATS)}")
    reader.read_metadata()
    meta = reader.source.header(0).meta
    models = meta.get("models") or {}
    if model is not None and model not in models:
        raise StateError(f"{reader.source.describe(0)} has no model {model!r}; it holds "
                         f"{', '.join(models)}")
    names = list(models) if model is None else [model]
    aliases = meta.get("aliases") or {}
    keys = {(f"{m}.{k}" if len(names) > 1 else k): aliases.get(f"model/{m}/{k}", f"model/{m}/{k}")
            for m in names for k in models[m]}
    out = Path(out_path)
    if fmt == "pt":
        import torch
        tensors = {key: reader.full_tensor(name) for key, name in keys.items()}
        replace_atomic(out, lambda p: torch.save(tensors, p))
        return list(keys)
    replace_atomic(out, lambda p: _stream_safetensors(p, reader, keys, reader.source.step))
    return list(keys)


def _stream_safetensors(path: Path, reader: "MemckptReader", keys: dict[str, str], step: int) -> None:
    """The safetensors layout (u64 header length, JSON header, raw bytes), one tensor at a time."""
    import json
    import math
    import struct

    import torch

    header: dict[str, Any] = {"__metadata__": {"format": "pt", "memckpt_step": str(step)}}
    at = 0
    for key, name in keys.items():
        shape, dtype = reader.global_shape[name], reader.dtype[name]
        n = math.prod(shape) * shardfmt.ITEMSIZE[dtype]
        header[key] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                       "data_offsets": [at, at + n]}
        at += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        for name in keys.values():
            t = reader.full_tensor(name).contiguous().view(-1)
            f.write(memoryview(t.view(torch.uint8).numpy()) if t.numel() else b"")


def export_dcp(reader: "MemckptReader", out_dir: str | os.PathLike) -> list[str]:
    """Write a standard DCP checkpoint (``FileSystemWriter``) of the model and optimizer
    state under the reader's names (:mod:`memckpt.format.dcp_reader`), loadable with plain
    ``torch.distributed.checkpoint.load``. Tensors are assembled and written one at a
    time (the plan holds shapes only, on the meta device)."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    reader.read_metadata()
    by_fqn = {fqn: name for name, fqn in reader.fqn_of.items()}
    plan: dict[str, Any] = {fqn: torch.empty(reader.global_shape[name], device="meta",
                                             dtype=shardfmt.torch_dtypes()[reader.dtype[name]])
                            for fqn, name in by_fqn.items()}
    plan.update(reader.objects())

    class _Planner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            name = by_fqn.get(index.fqn)
            return reader.full_tensor(name) if name is not None else super().lookup_object(index)

    writer = dcp.FileSystemWriter(os.fspath(out_dir), thread_count=1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(plan, storage_writer=writer, planner=_Planner(flatten_state_dict=False), no_dist=True)
    return sorted(plan)
