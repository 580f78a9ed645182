"""Read memckpt checkpoints through ``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(sd, storage_reader=memckpt.dcp_reader("s3://bucket/ckpt"))

:class:`MemckptReader` is a DCP ``StorageReader`` over memckpt's shard format.
``read_metadata`` merges every rank's tensor table into one global ``Metadata``
(a DTensor's local chunk is one ``ChunkStorageMetadata`` at its offsets; a tensor
several ranks hold whole, like a DDP parameter, is listed once); DCP's load planner
then computes which part of which chunk each rank needs, and ``read_data`` reads
only the byte ranges holding those parts, verifying every checksum chunk it reads.

Names (DCP FQNs) of a checkpoint's tensors, the keys of ``torch.distributed.
checkpoint.state_dict`` and torchtitan:

- ``model.<key>``: a model's ``state_dict`` key (a TrainState with several
  models: ``model.<model name>.<key>``);
- ``optim.state.<param>.<state key>`` (``exp_avg``, ``step``...) and
  ``optim.param_groups.<i>.<hyperparameter>`` / ``.params``, where ``<param>`` is
  the parameter's name in its model (several models: ``<model name>.<name>``;
  several optimizers: ``optim.<optimizer name>.state...``).

Scheduler, scaler, RNG, data position and extras are not exposed: memckpt's own
restore brings them back (:mod:`memckpt.format.reshard`).
"""

from __future__ import annotations

import abc
import functools
import io
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import numpy as np
import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                   Metadata, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from memckpt.format import shard as fmt
from memckpt.errors import ChecksumError, StateError
from memckpt.format.state import unflatten

MERGE_LIMIT = 16 << 20  # ranges of one shard read together up to this many bytes
MERGE_GAP = fmt.CHUNK_BYTES  # ... when less than a checksum chunk apart (else it is read twice)


@dataclass(frozen=True)
class ShardHeader:
    """One rank's verified header: its metadata, tensor table and checksum chunks."""

    header: dict[str, Any]
    layout: fmt.Layout
    data_offset: int
    source: str

    @functools.cached_property
    def entries(self) -> dict[str, fmt.TensorEntry]:
        return {e.name: e for e in self.layout.entries}

    @functools.cached_property
    def chunks(self) -> Optional[fmt.Chunks]:
        return fmt.Chunks.of(self.header, self.data_offset)

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.get("meta", {})

    def placement(self, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(global shape, offsets of this rank's chunk) of tensor ``name``: a tensor absent
        from ``meta["dtensors"]`` is whole (global shape = local shape, offsets 0)."""
        local = self.entries[name].shape
        dt = (self.meta.get("dtensors") or {}).get(name)
        if dt is None:
            return local, (0,) * len(local)
        return tuple(int(s) for s in dt["global_shape"]), tuple(int(o) for o in dt["offsets"])


class ShardSource(abc.ABC):
    """The shards of one committed step of N ranks, read by byte range.

    Subclasses give :meth:`read` (bytes of rank ``r``'s shard) and :meth:`describe`;
    :meth:`check` may compare a header with what a manifest promised.
    ``bytes_read`` counts every byte fetched.
    """

    def __init__(self, world_size: int, step: int) -> None:
        self.world_size, self.step = world_size, step
        self.bytes_read = 0
        self._headers: dict[int, ShardHeader] = {}

    @abc.abstractmethod
    def read(self, rank: int, offset: int, length: int) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of rank ``rank``'s shard (uint8)."""

    @abc.abstractmethod
    def describe(self, rank: int) -> str:
        """Where rank ``rank``'s shard is, for messages."""

    def check(self, rank: int, header: dict[str, Any]) -> None:  # noqa: B027 (optional hook)
        """Raise :class:`ChecksumError` if ``header`` is not the shard expected."""

    def _fetch(self, rank: int, offset: int, length: int) -> np.ndarray:
        buf = self.read(rank, offset, length)
        self.bytes_read += len(buf)
        if len(buf) != length:
            raise ChecksumError(f"{self.describe(rank)}: truncated: {offset + len(buf)} bytes, the "
                                f"header promises at least {offset + length}")
        return buf

    def header(self, rank: int) -> ShardHeader:
        if rank not in self._headers:
            source = self.describe(rank)
            end = fmt.header_end(self._fetch(rank, 0, fmt.PREFIX.size), source)
            h, layout, cap = fmt.read_header(self._fetch(rank, 0, end), source, check_length=False)
            if int(h["step"]) != self.step:
                raise ChecksumError(f"{source}: holds step {h['step']}, expected {self.step}")
            if h.get("rank", rank) != rank or h.get("world_size", self.world_size) != self.world_size:
                raise ChecksumError(f"{source}: is rank {h.get('rank')} of {h.get('world_size')}, "
                                    f"expected rank {rank} of {self.world_size}")
            self.check(rank, h)
            self._headers[rank] = ShardHeader(h, layout, fmt.data_offset(cap), source)
        return self._headers[rank]

    def read_data(self, rank: int, start: int, end: int) -> np.ndarray:
        """Bytes ``[start, end)`` of rank ``rank``'s data region, checksums verified: the
        whole checksum chunks around the range are read (the whole region for a shard
        sealed without chunk checksums)."""
        h = self.header(rank)
        data_len = h.layout.data_len
        chunks = h.chunks
        if chunks is None:
            data = self._fetch(rank, h.data_offset, data_len)
            got = fmt.checksum(data)
            if got != h.header["data_xxh3"]:
                raise ChecksumError(f"{h.source}: data checksum mismatch (stored "
                                    f"{h.header['data_xxh3']}, computed {got}): the shard is corrupt")
            return data[start:end]
        size = chunks.chunk_bytes
        first, last = start // size, max(start // size + 1, -(-end // size))
        lo, hi = first * size, min(last * size, data_len)
        buf = self._fetch(rank, h.data_offset + lo, hi - lo)
        for i in range(first, last):
            a, b = i * size - lo, min((i + 1) * size, data_len) - lo
            got = fmt.checksum(buf[a:b])
            if got != chunks.digests[i]:
                raise ChecksumError(f"{h.source}: data checksum mismatch in chunk {i} (stored "
                                    f"{chunks.digests[i]}, computed {got}): the shard is corrupt")
        return buf[start - lo: end - lo]

    def read_tensor(self, rank: int, name: str) -> torch.Tensor:
        """Rank ``rank``'s whole local tensor ``name`` (verified, owning its memory)."""
        h = self.header(rank)
        try:
            e = h.entries[name]
        except KeyError:
            raise StateError(f"{h.source} has no tensor {name!r}") from None
        raw = self.read_data(rank, e.offset, e.offset + e.nbytes)
        return _typed(raw, e.dtype).reshape(e.shape)


def _typed(raw: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw)).view(fmt.torch_dtypes()[dtype])


# -- names ----------------------------------------------------------------------------------------
def dcp_names(meta: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """DCP FQNs of a shard: ({memckpt tensor name: FQN}, {FQN: non-tensor value}).

    Non-tensor values (hyperparameters, parameter names) are JSON as captured; a value
    that is a tensor marker stays a marker (read it with :meth:`ShardSource.read_tensor`).
    """
    tensors: dict[str, str] = {}
    objects: dict[str, Any] = {}
    models = meta.get("models") or {}
    several = len(models) > 1
    aliases = meta.get("aliases") or {}
    for mname, keys in models.items():
        for key in keys:
            name = f"model/{mname}/{key}"
            if name not in aliases:
                tensors[name] = f"model.{mname}.{key}" if several else f"model.{key}"

    def param(pname: str) -> str:
        mname, fqn = pname.split("/", 1)
        return f"{mname}.{fqn}" if several else fqn

    optimizers = meta.get("optimizers") or {}
    for oname, saved in optimizers.items():
        base = f"optim.{oname}" if len(optimizers) > 1 else "optim"
        for pname, st in saved["state"].items():
            _walk(st, f"{base}.state.{param(pname)}", tensors, objects)
        for i, group in enumerate(saved["param_groups"]):
            for k, v in group.items():
                path = f"{base}.param_groups.{i}.{k}"
                if k == "params":
                    objects[path] = [param(p) for p in v]
                else:
                    _walk(v, path, tensors, objects)
    return tensors, objects


def _walk(obj: Any, path: str, tensors: dict[str, str], objects: dict[str, Any]) -> None:
    if isinstance(obj, dict) and "__tensor__" in obj:
        tensors[obj["__tensor__"]] = path
    elif isinstance(obj, dict) and not any(k.startswith("__") for k in obj):
        for k, v in obj.items():
            _walk(v, f"{path}.{k}", tensors, objects)
    elif isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        for i, v in enumerate(obj):
            _walk(v, f"{path}.{i}", tensors, objects)
    else:
        objects[path] = unflatten(obj, {})


@dataclass(frozen=True)
class _Stored:
    rank: int
    entry: fmt.TensorEntry


class MemckptReader(StorageReader):
    """A DCP ``StorageReader`` over a :class:`ShardSource` (see the module docstring)."""

    def __init__(self, source: ShardSource) -> None:
        super().__init__()
        self.source = source
        self._metadata: Optional[Metadata] = None
        self.by_name: dict[str, dict[tuple[int, ...], _Stored]] = {}  # memckpt name -> chunks
        self.fqn_of: dict[str, str] = {}  # memckpt tensor name -> FQN
        self.global_shape: dict[str, tuple[int, ...]] = {}  # memckpt name -> global shape
        self.dtype: dict[str, str] = {}
        self._chunks: dict[tuple[str, tuple[int, ...]], _Stored] = {}  # (FQN, offsets) ->
        self._objects: dict[str, Any] = {}

    # -- metadata -------------------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self._merge()
        return self._metadata

    def _merge(self) -> Metadata:
        md: dict[str, Any] = {}
        for rank in range(self.source.world_size):
            h = self.source.header(rank)
            names, objects = dcp_names(h.meta)
            for key, value in objects.items():
                if key.endswith(".params") and key in self._objects:  # ZeRO: each rank its own
                    have = self._objects[key]
                    self._objects[key] = have + [p for p in value if p not in have]
                else:
                    self._objects.setdefault(key, value)
            for e in h.layout.entries:
                shape, offsets = h.placement(e.name)
                known = self.global_shape.setdefault(e.name, shape)
                dtype = self.dtype.setdefault(e.name, e.dtype)
                if known != shape or dtype != e.dtype:
                    raise StateError(f"{h.source}: tensor {e.name!r} is {e.dtype} {list(shape)} here, "
                                     f"{dtype} {list(known)} in another rank's shard")
                held = self.by_name.setdefault(e.name, {})
                if offsets in held:  # replicated: any one holder serves it
                    continue
                held[offsets] = _Stored(rank, e)
                fqn = names.get(e.name)
                if fqn is None:  # scheduler, RNG, data...: memckpt's own
                    continue
                self.fqn_of[e.name] = fqn
                self._chunks[(fqn, offsets)] = _Stored(rank, e)
                if fqn not in md:
                    md[fqn] = TensorStorageMetadata(
                        TensorProperties(dtype=fmt.torch_dtypes()[e.dtype]), torch.Size(shape), [])
                md[fqn].chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(e.shape)))
        for key in self._objects:
            md[key] = BytesStorageMetadata()
        for name, chunks in self.by_name.items():
            covered = sum(math.prod(s.entry.shape) for s in chunks.values())
            if covered < math.prod(self.global_shape[name]):
                raise StateError(f"{self.source.describe(0)} (step {self.source.step}): the shards "
                                 f"hold only part of tensor {name!r} ({covered} of "
                                 f"{math.prod(self.global_shape[name])} elements)")
        return Metadata(state_dict_metadata=md)

    def full_tensor(self, name: str) -> torch.Tensor:
        """Tensor ``name`` (a memckpt name) whole, assembled from its chunks one at a time
        (memory: the tensor and one chunk)."""
        self.read_metadata()
        if name not in self.by_name:
            raise StateError(f"{self.source.describe(0)} has no tensor {name!r}")
        out = torch.empty(self.global_shape[name], dtype=fmt.torch_dtypes()[self.dtype[name]])
        for offsets, stored in self.by_name[name].items():
            chunk = self.source.read_tensor(stored.rank, name)
            out[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))] = chunk
        return out

    def objects(self) -> dict[str, Any]:
        """The non-tensor values by FQN (hyperparameters, parameter names)."""
        self.read_metadata()
        return dict(self._objects)

    # -- StorageReader --------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False  # built with memckpt.dcp_reader(...), never picked from an id

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        # read_data needs this reader's own index of the chunks, not only DCP's Metadata:
        # a rank that did not read the metadata itself builds it on first use
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.read_metadata()
        ranges: list[tuple[int, int, int, ReadItem, _Stored]] = []  # rank, start, end, item, chunk
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                value = self._objects[item.storage_index.fqn]
                buf = io.BytesIO()
                torch.save(value, buf)
                buf.seek(0)
                planner.load_bytes(item, buf)
                continue
            stored = self._chunks[(item.storage_index.fqn, tuple(item.storage_index.offset or ()))]
            first, last = _span(stored.entry.shape, item.storage_offsets, item.lengths)
            size = fmt.ITEMSIZE[stored.entry.dtype]
            ranges.append((stored.rank, stored.entry.offset + first * size,
                           stored.entry.offset + last * size, item, stored))
        ranges.sort(key=lambda r: (r[0], r[1]))
        for group in _coalesce(ranges):
            rank, lo, hi = group[0][0], group[0][1], max(r[2] for r in group)
            raw = self.source.read_data(rank, lo, hi)
            for _, start, end, item, stored in group:
                self._copy(item, stored, raw[start - lo: end - lo], planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _copy(item: ReadItem, stored: _Stored, raw: np.ndarray, planner: LoadPlanner) -> None:
        shape = stored.entry.shape
        flat = _typed(raw, stored.entry.dtype)
        src = torch.as_strided(flat, tuple(item.lengths), _strides(shape)) if shape else flat.reshape(())
        target = planner.resolve_tensor(item).detach()
        if target.shape != src.shape:
            raise StateError(f"{item.dest_index.fqn}: the planner asked for {list(target.shape)}, the "
                             f"checkpoint's chunk gives {list(src.shape)}")
        target.copy_(src)
        planner.commit_tensor(item, target)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _span(shape: tuple[int, ...], offsets: Iterable[int], lengths: Iterable[int]) -> tuple[int, int]:
    """Elements [first, last) of a contiguous chunk of ``shape`` that cover the box
    ``offsets`` + ``lengths`` (rows of a dim-0 slice are one contiguous run)."""
    offsets, lengths = tuple(offsets), tuple(lengths)
    if not shape:
        return 0, 1
    strides = _strides(shape)
    if 0 in lengths:
        return 0, 0
    first = sum(o * s for o, s in zip(offsets, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, strides)) + 1
    return first, last


def _coalesce(ranges: list[tuple[int, int, int, ReadItem, _Stored]]) -> Iterable[list]:
    group: list = []
    for r in ranges:
        if group and (r[0] != group[0][0] or r[1] > max(g[2] for g in group) + MERGE_GAP
                      or r[2] - group[0][1] > MERGE_LIMIT):
            yield group
            group = []
        group.append(r)
    if group:
        yield group
