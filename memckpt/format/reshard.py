"""Restore a checkpoint written by N ranks in one layout into this rank of M in another.

Parameters and optimizer state go through DCP's load planner over
:class:`~memckpt.format.dcp_reader.MemckptReader`: this rank reads only the byte ranges of
the stored chunks that overlap its own (FSDP2/TP: its DTensor shards; DDP: every
parameter, whole; ZeRO: the state of the parameters it now owns). What is global is
taken from rank 0's shard as it is: step, schedulers, scaler, data position (a
:class:`memckpt.ResumableSampler` counts global samples) and extras. RNG streams
are per rank: rank r < N takes old rank r's; a new rank r >= N is seeded from the
checkpoint (xxh3 of rank 0's torch RNG state and r), so a resharded resume is
deterministic, but its losses follow the new layout, not the old run's.
"""

from __future__ import annotations

import random
import warnings
from typing import Any, Iterable, Optional

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import xxhash

from memckpt.format import dtensor as dt
from memckpt.format import shard as fmt
from memckpt.format.dcp_reader import MemckptReader
from memckpt.errors import IncompatibleCheckpointError, MemckptError
from memckpt.format.state import TrainState


def markers(obj: Any) -> Iterable[str]:
    """The tensor names a captured JSON skeleton refers to."""
    if isinstance(obj, dict):
        for key in ("__tensor__", "__ndarray__"):
            if key in obj:
                yield obj[key]
                return
        for v in obj.values():
            yield from markers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from markers(v)


def mismatch(reader: MemckptReader, state: TrainState) -> Optional[str]:
    """The first difference that makes the checkpoint unloadable into ``state`` (model
    names, keys, global shapes and dtypes; optimizer names), or None."""
    reader.read_metadata()
    meta = reader.source.header(0).meta
    stored = meta.get("models") or {}
    if set(stored) != set(state.models):
        return f"model names differ: the checkpoint has {sorted(stored)}, the job {sorted(state.models)}"
    aliases = meta.get("aliases") or {}
    for mname, m in state.models.items():
        keys = set(stored[mname])
        live = m.state_dict()
        for key in live:
            if key not in keys:
                return f"tensor 'model/{mname}/{key}' is not in the checkpoint"
        for key in sorted(keys - set(live)):
            return f"tensor 'model/{mname}/{key}' of the checkpoint is not in the job's model"
        for key, t in live.items():
            name = aliases.get(f"model/{mname}/{key}", f"model/{mname}/{key}")
            shape, dtype = reader.global_shape.get(name), reader.dtype.get(name)
            if shape is None:
                return f"tensor {name!r} is missing from the checkpoint's shards"
            if shape != tuple(t.shape) or dtype != fmt.dtype_name(t.dtype):
                return (f"tensor 'model/{mname}/{key}' is {dtype} {list(shape)} in the checkpoint, "
                        f"{fmt.dtype_name(t.dtype)} {list(t.shape)} in the job")
    saved = meta.get("optimizers") or {}
    if set(saved) != set(state.optimizers):
        return (f"optimizer names differ: the checkpoint has {sorted(saved)}, the job "
                f"{sorted(state.optimizers)}")
    return None


def check_compatible(reader: MemckptReader, state: TrainState, what: str) -> None:
    problem = mismatch(reader, state)
    if problem:
        raise IncompatibleCheckpointError(
            f"{what} cannot be loaded into this job: {problem}. It is left untouched; point the job "
            "at another persistence root, or set load=LoadSpec(on_incompatible='start_fresh') to "
            "start from step 0 beside it")


def load_resharded(state: TrainState, reader: MemckptReader, rank: int,
                   kinds: frozenset[str]) -> int:
    """Load ``reader``'s checkpoint into ``state`` as rank ``rank`` of the current layout;
    returns its step. Nothing is changed when the checkpoint is incompatible."""
    src = reader.source
    check_compatible(reader, state, f"{src.describe(0)} (step {src.step})")
    meta0 = src.header(0).meta
    targets: dict[str, Any] = {}  # DCP FQN -> the tensor that receives it
    if "model" in kinds:
        aliases = meta0.get("aliases") or {}
        for mname, m in state.models.items():
            for key, t in m.state_dict().items():
                name = aliases.get(f"model/{mname}/{key}", f"model/{mname}/{key}")
                targets.setdefault(reader.fqn_of[name], t)  # loaded in place
    opt_meta, opt_tensors = ({}, {}) if "optimizer" not in kinds else \
        _optimizer_targets(state, reader, targets)
    if targets:
        with warnings.catch_warnings():  # every rank plans its own reads: no collective
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp.load(targets, storage_reader=reader, no_dist=True)
            except CheckpointException as e:  # DCP wraps what the reader raised: say that
                for exc, _tb in e.failures.values():
                    if isinstance(exc, MemckptError):
                        raise exc from None
                raise
    # what a shard of this rank would hold: local chunks and their layout records
    meta = dict(meta0, optimizers=opt_meta, aliases={},  # the models are loaded already
                dtensors={n: dt.chunk_meta(t) for n, t in opt_tensors.items() if dt.is_dtensor(t)})
    tensors = {n: dt.local(t) for n, t in opt_tensors.items()}
    rest = set(kinds) - {"model"}
    for part in ("schedulers", "scaler", "data"):
        for name in markers(meta0.get(part)):
            tensors[name] = src.read_tensor(0, name)
    if "rng" in rest and meta0.get("rng") is not None:
        if rank < src.world_size:
            meta["rng"] = src.header(rank).meta.get("rng")
            for name in markers(meta["rng"]):
                tensors[name] = src.read_tensor(rank, name)
        else:
            rest.discard("rng")
            seed_new_rank(src.read_tensor(0, "rng/torch"), rank)
    if "optimizer" not in kinds:
        rest.discard("optimizer")
    return state.load(tensors, meta, rest, clone=False)  # the optimizer state was made here


def reported(reader: MemckptReader) -> Optional[dict[str, float]]:
    """The metrics (the loss) the checkpoint's rank 0 reported for its step: a resharded
    resume gives them back as a same-layout one does (the job's loss curve keeps the step
    it resumed from, whose own report may have gone with the failure)."""
    return fmt.report_of(reader.source.header(0).meta)


def _optimizer_targets(state: TrainState, reader: MemckptReader, targets: dict[str, Any]
                       ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """For each optimizer: the metadata a shard of this rank would hold, and empty tensors
    laid out like this rank's parameters (DTensors where they are) for DCP to fill."""
    src = reader.source
    params = state.named_params()
    metas = [src.header(r).meta.get("optimizers") or {} for r in range(src.world_size)]
    opt_meta: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for oname in state.optimizers:
        saved: dict[str, Any] = {}
        for m in metas:  # ZeRO: each parameter's state is in its owner's shard
            for pname, st in m[oname]["state"].items():
                saved.setdefault(pname, st)
        groups = state.optimizer_params(oname)
        state_meta = {}
        for pname in (p for g in groups for p in g):
            if pname not in saved:
                continue  # the parameter had no state yet (never stepped)
            state_meta[pname] = saved[pname]
            p = params[pname]
            for name in markers(saved[pname]):
                shape, dtype = reader.global_shape[name], fmt.torch_dtypes()[reader.dtype[name]]
                if dt.is_dtensor(p) and tuple(p.shape) == shape:
                    t = torch.empty_like(p, dtype=dtype)
                else:
                    t = torch.empty(shape, dtype=dtype)
                tensors[name] = t
                targets[reader.fqn_of[name]] = t
        groups_meta = metas[0][oname]["param_groups"]
        opt_meta[oname] = {"state": state_meta,
                           "param_groups": [dict(g, params=cur) for g, cur in zip(groups_meta, groups)]}
    return opt_meta, tensors


def seed_new_rank(base: torch.Tensor, rank: int) -> None:
    """Seed python, numpy and torch for a rank the checkpoint had no stream for."""
    seed = xxhash.xxh3_64_intdigest(base.contiguous().numpy().tobytes() + rank.to_bytes(8, "little"))
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    torch.manual_seed(seed)
