"""The shard format: one flat binary region per rank and step, never pickle.

The same bytes serve as an in-RAM snapshot slot, a replica on a peer and a file
on disk, so moving a shard is a byte copy and loading one cannot run code::

    0   magic  b"MEMCKPT\\x01"
    8   u32    format version
    12  u32    state: 0 = being written, 1 = complete
    16  u64    header capacity (bytes reserved at offset 64)
    24  u64    header length
    32  u64    xxh3-64 of the header bytes
    40  u64    data offset (4096-aligned)
    48  u64    data length
    56  u64    step
    64  header JSON: tensor table (name, dtype, shape, offset, nbytes), metadata,
        xxh3-64 of each ``chunk_bytes`` chunk of the data region (what lets a replica
        holder fill chunks it already holds, see
        :meth:`memckpt.runtime.node.replica_store.ReplicaStore.fill_local`), and the data
        digest ``data_xxh3``
    ... data: each tensor's bytes, contiguous, 64-byte aligned

Format 2 (written now): ``data_xxh3`` is the xxh3-64 of the chunk digests' hex text,
so the chunks are hashed independently, on as many threads as the caller gives
(xxhash releases the GIL), and every byte is hashed once. Format 1 (still read):
``data_xxh3`` is one sequential xxh3-64 over the whole data region.

A writer sets state=0, fills data, then writes the header and sets state=1
last, so a reader of a torn region sees state 0 and refuses it.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterable, Iterator, Mapping, Optional, Sequence

import numpy as np
import xxhash

from memckpt.errors import ChecksumError, StateError
from memckpt.policy.footprint import SLOTS

if TYPE_CHECKING:
    import torch

MAGIC = b"MEMCKPT\x01"
# A rank's slots in its folder, one per copy the footprint plans (SLOTS: a committed and an
# in-flight one); the snapshot engine writes them, a node's store holds a replica's under
# the same names
SLOT_NAMES = tuple(f"slot{i}.shard" for i in range(SLOTS))
FORMAT_VERSION = 2  # written; see the module docstring
READ_VERSIONS = (1, 2)  # read
PREFIX = struct.Struct("<8sIIQQQQQQ")  # 64 bytes
assert PREFIX.size == 64
STATE_WRITING, STATE_COMPLETE = 0, 1
STATE_OFFSET, _STATE_END = 12, 16  # the state field's bytes in PREFIX
DATA_ALIGN = 4096
TENSOR_ALIGN = 64
CHUNK_BYTES = 256 << 10  # granularity of the per-chunk checksums (grows for huge shards)
MAX_CHUNKS = 4096  # so the chunk list stays well inside a header and a transport message
HASH_BATCHES = 64  # tasks a thread pool gets per seal or check (a few per thread)
_CHUNK_DIGEST_BYTES = 19  # one "0123456789abcdef", in JSON

# Bytes per element of every dtype a shard may hold. Kept apart from torch so the replica
# stores and the coordinator, which read headers and move bytes, never import it.
ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
            "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8, "complex128": 16,
            "float8_e4m3fn": 1, "float8_e5m2": 1}


@functools.cache
def torch_dtypes() -> dict[str, "torch.dtype"]:
    import torch
    return {name: getattr(torch, name) for name in ITEMSIZE if hasattr(torch, name)}


@functools.cache
def _dtype_names() -> dict["torch.dtype", str]:
    return {v: k for k, v in torch_dtypes().items()}


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def checksum(data: np.ndarray | memoryview) -> str:
    """xxh3-64 of a byte region, as 16 hex digits. Releases the GIL while hashing."""
    return xxhash.xxh3_64_hexdigest(memoryview(data))


def chunks_covering(start: int, end: int, chunk_bytes: int) -> range:
    """The indices of the data chunks of ``chunk_bytes`` that bytes ``start .. end`` touch."""
    return range(start // chunk_bytes, (end - 1) // chunk_bytes + 1) if end > start else range(0)


def chunk_bytes_for(data_len: int) -> int:
    """Chunk size of a data region: CHUNK_BYTES, doubled until at most MAX_CHUNKS chunks."""
    size = CHUNK_BYTES
    while size * MAX_CHUNKS < data_len:
        size *= 2
    return size


def checksums(data: np.ndarray | memoryview, chunk_bytes: int) -> tuple[str, list[str]]:
    """Format 1's digests: xxh3-64 of ``data`` and of each ``chunk_bytes`` chunk of it, in
    one sequential pass (each chunk hashed twice while it sits in cache)."""
    whole, chunks = xxhash.xxh3_64(), []
    view = memoryview(data).cast("B")
    for off in range(0, len(view), chunk_bytes):
        part = view[off: off + chunk_bytes]
        whole.update(part)
        chunks.append(xxhash.xxh3_64_hexdigest(part))
    return whole.hexdigest(), chunks


# How chunk work is spread: ``map``-like (the builtin runs it on the calling thread, a
# thread pool's ``map`` spreads it over the pool's threads; order is kept either way).
MapFn = Callable[[Callable[[Any], Any], Iterable[Any]], Iterator[Any]]


# ``ready(start, end)`` blocks until the data bytes in [start, end) are in place (a copy
# still landing, see memckpt.engine.landing); the seal hashes a batch of chunks after it.
Ready = Callable[[int, int], None]


def chunk_digests(data: np.ndarray | memoryview, chunk_bytes: int,
                  map_fn: MapFn = map, ready: Optional[Ready] = None,
                  known: Optional[Mapping[int, str]] = None) -> list[str]:
    """xxh3-64 of each ``chunk_bytes`` chunk of ``data``, computed through ``map_fn``, each
    batch once ``ready`` says its bytes have landed. ``known``: chunk index -> digest of
    chunks whose bytes are known unchanged since they were hashed (taken, not hashed)."""
    view = memoryview(data).cast("B")
    known = known or {}
    offsets = [off for off in range(0, len(view), chunk_bytes)
               if off // chunk_bytes not in known]
    runs = [(ready, view, chunk_bytes, run) for run in batched(offsets)]
    hashed = dict(zip(offsets, (d for batch in map_fn(_checksum_run, runs) for d in batch)))
    return [known[off // chunk_bytes] if off // chunk_bytes in known else hashed[off]
            for off in range(0, len(view), chunk_bytes)]


def _checksum_run(job: tuple[Optional[Ready], memoryview, int, Sequence[int]]) -> list[str]:
    # each hashing thread waits for its own batch to land: tried on an H200, one thread
    # waiting and handing batches over sealed 4 GiB later (1.39x the copy, not 1.28x)
    ready, view, chunk_bytes, run = job
    if not run:
        return []
    if ready is not None:  # a run may skip known chunks: it waits for its whole span
        ready(run[0], min(run[-1] + chunk_bytes, len(view)))
    return [checksum(view[off: off + chunk_bytes]) for off in run]


def batched(items: Sequence[Any], batches: int = HASH_BATCHES) -> list[Sequence[Any]]:
    """``items`` in at most ``batches`` consecutive runs: one task per run, not per chunk."""
    size = max(1, -(-len(items) // batches))
    return [items[i: i + size] for i in range(0, len(items), size)]


def digest_of_chunks(digests: Sequence[str]) -> str:
    """A format-2 shard's ``data_xxh3``: the xxh3-64 of its chunk digests, concatenated."""
    return xxhash.xxh3_64_hexdigest("".join(digests).encode())


def data_digest(data: np.ndarray | memoryview, header: Mapping[str, Any],
                map_fn: MapFn = map) -> str:
    """The ``data_xxh3`` that ``data`` (a shard's data region) has under ``header``'s format."""
    if header.get("format", 1) >= 2:
        return digest_of_chunks(chunk_digests(data, int(header["chunk_bytes"]), map_fn))
    return checksum(data)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _dtype_names()[dtype]
    except KeyError:
        raise StateError(f"dtype {dtype} cannot be stored in a shard; supported: "
                            f"{', '.join(torch_dtypes())}") from None


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # from the start of the data region
    nbytes: int


@dataclass(frozen=True)
class Layout:
    """Where each tensor's bytes sit in a data region."""

    entries: tuple[TensorEntry, ...]
    data_len: int

    @staticmethod
    def of(tensors: Sequence[tuple[str, torch.Tensor]], chunk_at: int = -1) -> "Layout":
        """Tensors one after the other; the one at index ``chunk_at`` starts a new chunk
        (the first trained tensor after the frozen ones: no chunk holds both)."""
        entries, offset = [], 0
        for i, (name, t) in enumerate(tensors):
            if i == chunk_at and offset:
                offset = _round_up(offset, CHUNK_BYTES)
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(name, dtype_name(t.dtype), tuple(t.shape), offset, nbytes))
            offset = _round_up(offset + nbytes, TENSOR_ALIGN)
        return Layout(tuple(entries), offset)

    @functools.cached_property
    def spans(self) -> dict[str, tuple[int, int]]:
        """Each tensor's byte range in the data region, by name (made once per layout: a
        slot keeps its layout from one snapshot to the next)."""
        return {e.name: (e.offset, e.offset + e.nbytes) for e in self.entries}

    def to_json(self) -> list[list[Any]]:
        return [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]

    @functools.cached_property
    def table_bytes(self) -> int:
        """:func:`table_bytes` (once per layout: asked at every snapshot)."""
        chunks = -(-self.data_len // chunk_bytes_for(self.data_len))
        return len(json.dumps(self.to_json())) + chunks * _CHUNK_DIGEST_BYTES

    @staticmethod
    def from_json(rows: list[list[Any]], data_len: int, source: str) -> "Layout":
        entries = []
        for row in rows:
            try:
                name, dt, shape, offset, nbytes = row
                entry = TensorEntry(str(name), str(dt), tuple(int(s) for s in shape), int(offset),
                                    int(nbytes))
            except (TypeError, ValueError):
                raise ChecksumError(f"{source}: malformed tensor entry {row!r}") from None
            if entry.dtype not in ITEMSIZE:
                raise ChecksumError(f"{source}: tensor {entry.name!r} has unknown dtype {entry.dtype!r}")
            expect = math.prod(entry.shape) * ITEMSIZE[entry.dtype]
            if expect != entry.nbytes or entry.offset < 0 or entry.offset + entry.nbytes > data_len:
                raise ChecksumError(f"{source}: tensor {entry.name!r} lies outside the data region")
            entries.append(entry)
        return Layout(tuple(entries), data_len)


HEADER_ALIGN = 64 << 10  # a header grows in these steps: a few more tensors keep its size


def header_capacity_for(layout: Layout, meta_hint: int = 0) -> int:
    """Room for the header: the tensor table plus generous space for metadata, rounded so
    that a layout that gained a few tensors (Adam's moments after the first step) keeps
    its data where it was: the slots of the two layouts then share unchanged chunks."""
    return _round_up(table_bytes(layout) + 2 * meta_hint + 64 * 1024, HEADER_ALIGN) - PREFIX.size


def table_bytes(layout: Layout) -> int:
    """Header bytes that depend on the layout alone: the tensor table and the per-chunk
    checksums of its data region."""
    return layout.table_bytes


def region_size(layout: Layout, header_capacity: int) -> int:
    return PREFIX.size + header_capacity + layout.data_len


def data_offset(header_capacity: int) -> int:
    return PREFIX.size + header_capacity


def tensor_views(region: torch.Tensor, layout: Layout, header_capacity: int) -> dict[str, torch.Tensor]:
    """Typed, shaped views of each tensor's bytes inside a uint8 region (no copy)."""
    base = data_offset(header_capacity)
    views = {}
    for e in layout.entries:
        raw = region[base + e.offset: base + e.offset + e.nbytes]
        views[e.name] = raw.view(torch_dtypes()[e.dtype]).view(e.shape)
    return views


def mark_writing(region: np.ndarray) -> None:
    """Invalidate a region before its data is overwritten (a torn write stays invalid)."""
    PREFIX.pack_into(region, 0, MAGIC, FORMAT_VERSION, STATE_WRITING, 0, 0, 0, 0, 0, 0)


def fill_flagged(region: np.ndarray, offset: int, nbytes: int,
                 fill: Callable[[memoryview], None]) -> None:
    """Let ``fill`` write ``region[offset:offset+nbytes]`` of a shard arriving from elsewhere
    (a socket's ``recv_into``), in consecutive parts. The sender's prefix says "complete":
    it is flagged incomplete before any more bytes land, so a transfer cut short is never
    taken for a good shard; :func:`accept_received` flags it complete once verified."""
    view = memoryview(region)[offset: offset + nbytes]
    head = min(nbytes, PREFIX.size - offset) if offset < PREFIX.size else 0
    if head:
        fill(view[:head])
        if offset + head >= _STATE_END:  # the state field has landed: overrule it
            struct.pack_into("<I", region, STATE_OFFSET, STATE_WRITING)
    fill(view[head:])


def accept_received(region: np.ndarray, source: str, step: int,
                    verified: "tuple[Chunks, Collection[int]] | None" = None) -> "Shard":
    """Verify a shard received with :func:`fill_flagged`, then flag it complete (last, so a
    process killed mid-check leaves it incomplete). Raises :class:`ChecksumError`.

    ``verified``: (chunk table, indices) of data chunks already checked against that table
    (a holder's local fill): when the shard's own table is the same, only the other chunks
    are hashed again."""
    shard = open_shard(region, source, verify=False, require_complete=False)
    done: Collection[int] = ()
    if verified is not None and verified[0] == shard.chunks:
        done = verified[1]
    verify_data(shard, source, skip=done)
    if shard.step != step:
        raise ChecksumError(f"{source}: expected step {step}, got {shard.step}")
    struct.pack_into("<I", region, STATE_OFFSET, STATE_COMPLETE)
    return shard


def seal(region: np.ndarray, layout: Layout, header_capacity: int, step: int,
         header: Mapping[str, Any], map_fn: MapFn = map, ready: Optional[Ready] = None,
         known: Optional[Mapping[int, str]] = None,
         chunks_out: Optional[list[str]] = None) -> str:
    """Checksum the data (its chunks through ``map_fn``: a thread pool's ``map`` hashes
    them in parallel, each batch once ``ready`` says it landed; ``known`` chunks are taken
    as given), write the header, then flag the region complete. Returns the data digest;
    the chunk digests go to ``chunks_out``."""
    off = data_offset(header_capacity)
    size = chunk_bytes_for(layout.data_len)
    chunks = chunk_digests(region[off: off + layout.data_len], size, map_fn, ready, known)
    if chunks_out is not None:
        chunks_out[:] = chunks
    digest = digest_of_chunks(chunks)
    body = dict(header, step=step, tensors=layout.to_json(), data_len=layout.data_len,
                data_xxh3=digest, chunk_bytes=size, chunk_xxh3=chunks, format=FORMAT_VERSION)
    blob = json.dumps(body, separators=(",", ":")).encode()
    if len(blob) > header_capacity:
        raise ChecksumError(f"shard header of {len(blob)} bytes exceeds its reserved "
                            f"{header_capacity} bytes (metadata grew); the engine re-lays out")
    region[PREFIX.size: PREFIX.size + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    PREFIX.pack_into(region, 0, MAGIC, FORMAT_VERSION, STATE_WRITING, header_capacity, len(blob),
                     xxhash.xxh3_64_intdigest(blob), off, layout.data_len, step)
    # The state flag goes last: until it is set, no reader trusts this region.
    struct.pack_into("<I", region, STATE_OFFSET, STATE_COMPLETE)
    return digest


def report_of(meta: Mapping[str, Any]) -> Optional[dict[str, float]]:
    """The metrics (the loss) the rank reported for the step, kept in its shard's metadata
    (:meth:`memckpt.Checkpointer.snapshot`'s ``report``); None when it reported none."""
    return {k: float(v) for k, v in (meta.get("report") or {}).items()} or None


@dataclass(frozen=True)
class Shard:
    """A complete, verified shard: its header, layout and zero-copy tensor views."""

    header: dict[str, Any]
    layout: Layout
    raw: np.ndarray  # the shard's bytes (prefix + header + data): what a file or replica holds
    header_capacity: int

    @functools.cached_property
    def tensors(self) -> dict[str, "torch.Tensor"]:
        """Typed views of the data, made on first use (a store only moves bytes)."""
        import torch
        return tensor_views(torch.from_numpy(self.raw), self.layout, self.header_capacity)

    @property
    def step(self) -> int:
        return int(self.header["step"])

    @property
    def nbytes(self) -> int:
        return len(self.raw)

    @property
    def meta(self) -> dict[str, Any]:
        return self.header.get("meta", {})

    @functools.cached_property
    def chunks(self) -> "Chunks | None":
        """The per-chunk checksums, if the shard was sealed with them."""
        return Chunks.of(self.header, data_offset(self.header_capacity))


@dataclass(frozen=True)
class Chunks:
    """Where a shard's data chunks sit in its bytes and their xxh3-64 digests."""

    data_offset: int
    chunk_bytes: int
    digests: tuple[str, ...]

    @staticmethod
    def of(header: Mapping[str, Any], data_offset: int) -> "Chunks | None":
        size, digests = header.get("chunk_bytes"), header.get("chunk_xxh3")
        if not isinstance(size, int) or size <= 0 or not isinstance(digests, list):
            return None  # sealed before chunk checksums existed
        return Chunks(data_offset, size, tuple(str(d) for d in digests))

    def span(self, index: int, data_len: int) -> tuple[int, int]:
        """(offset in the shard's bytes, length) of chunk ``index``."""
        start = index * self.chunk_bytes
        return self.data_offset + start, min(self.chunk_bytes, data_len - start)


def gap_runs(layout: Layout, header_capacity: int) -> list[tuple[int, int]]:
    """(offset, length) of the whole pages of a shard's data that hold no tensor byte: the
    gaps tensors are aligned across (a chunk boundary after the frozen ones)."""
    base, at, out = data_offset(header_capacity), 0, []
    for e in sorted(layout.entries, key=lambda e: e.offset):
        start, stop = _round_up(base + at, 4096), (base + e.offset) // 4096 * 4096
        if stop > start:
            out.append((start, stop - start))
        at = max(at, e.offset + e.nbytes)
    return out


def zero_runs(region: np.ndarray, source: str = "shard") -> list[tuple[int, int]]:
    """(offset, length) of the whole pages of a complete shard that hold no byte of it: the
    header's room past the header and :func:`gap_runs`. Zeros (a slot's engine clears its
    gaps before it seals), left unallocated in a slot file: a reader sends them as zeros
    instead of reading them (a hole read through a shared mapping takes a page). [] where
    ``region`` does not start with a readable header."""
    try:
        end = header_end(region[:PREFIX.size], source)
        _, layout, cap = read_header(region[:end], source, check_length=False)
    except ChecksumError:
        return []
    start, stop = _round_up(end, 4096), data_offset(cap)
    return ([(start, stop - start)] if stop > start else []) + gap_runs(layout, cap)


def header_room(prefix: np.ndarray | bytes, source: str) -> tuple[int, int]:
    """[start, stop): the whole pages of a shard's header room past its header, from its
    64-byte prefix: they hold no byte of the shard and no checksum covers them. Raises
    :class:`ChecksumError` for a prefix that is not a shard's."""
    end = header_end(prefix, source)
    cap = PREFIX.unpack_from(bytes(prefix[:PREFIX.size]), 0)[3]
    return _round_up(end, 4096), data_offset(cap)


def header_end(prefix: np.ndarray | bytes, source: str) -> int:
    """Where a shard's header ends, from its 64-byte prefix: the bytes to read for
    :func:`read_header` with ``check_length=False`` (a ranged read of a stored shard)."""
    if len(prefix) < PREFIX.size:
        raise ChecksumError(f"{source}: truncated ({len(prefix)} bytes, less than the 64-byte prefix)")
    magic, _version, _state, cap, hlen = PREFIX.unpack_from(bytes(prefix[:PREFIX.size]), 0)[:5]
    if magic != MAGIC or hlen > cap:
        raise ChecksumError(f"{source}: not a memckpt shard (bad magic or corrupt prefix)")
    return PREFIX.size + hlen


def read_header(region: np.ndarray, source: str, check_length: bool = True,
                require_complete: bool = True) -> tuple[dict[str, Any], Layout, int]:
    """Parse and check the prefix and header; returns (header, layout, header_capacity).

    ``check_length=False`` accepts a region holding only the prefix and header.
    """
    if len(region) < PREFIX.size:
        raise ChecksumError(f"{source}: truncated ({len(region)} bytes, less than the 64-byte prefix)")
    magic, version, state, cap, hlen, hsum, off, dlen, step = PREFIX.unpack_from(region, 0)
    if magic != MAGIC:
        raise ChecksumError(f"{source}: not a memckpt shard (bad magic)")
    if version not in READ_VERSIONS:
        raise ChecksumError(f"{source}: shard format {version}, this memckpt reads "
                            f"{', '.join(map(str, READ_VERSIONS))}: upgrade memckpt to read it")
    if require_complete and state != STATE_COMPLETE:
        raise ChecksumError(f"{source}: incomplete shard (its write never finished)")
    if hlen > cap or off != PREFIX.size + cap:
        raise ChecksumError(f"{source}: corrupt prefix")
    if check_length and len(region) < off + dlen:
        raise ChecksumError(f"{source}: truncated: {len(region)} bytes, the header promises {off + dlen}")
    blob = bytes(region[PREFIX.size: PREFIX.size + hlen])
    if xxhash.xxh3_64_intdigest(blob) != hsum:
        raise ChecksumError(f"{source}: header checksum mismatch")
    try:
        header = json.loads(blob)
    except ValueError:
        raise ChecksumError(f"{source}: header is not valid JSON") from None
    if header.get("step") != step or header.get("data_len") != dlen or \
            header.get("format", 1) != version:
        raise ChecksumError(f"{source}: header disagrees with its prefix")
    return header, Layout.from_json(header["tensors"], dlen, source), cap


def open_shard(region: np.ndarray, source: str, verify: bool = True,
               require_complete: bool = True) -> Shard:
    """Open a shard held in ``region`` (bytes of a file, mmap or slot) without copying.

    With ``verify`` the data checksum is checked and a mismatch raises
    :class:`ChecksumError` naming ``source``. The returned tensors alias ``region``.
    """
    region = np.asarray(region, dtype=np.uint8).reshape(-1)
    header, layout, cap = read_header(region, source, require_complete=require_complete)
    shard = Shard(header, layout, region[: data_offset(cap) + layout.data_len], cap)
    if verify:
        verify_data(shard, source)
    return shard


def verify_data(shard: Shard, source: str, skip: Collection[int] = (),
                map_fn: MapFn = map) -> None:
    """Raise :class:`ChecksumError` naming ``source`` unless the data of ``shard`` (opened
    with ``verify=False``) matches its header's checksums. Format 2, or ``skip`` (chunks
    verified already): every other chunk against its chunk digest, through ``map_fn`` (a
    thread pool's ``map`` verifies them in parallel). Format 1 otherwise: the whole
    region's sequential digest."""
    chunks = shard.chunks
    v2 = shard.header.get("format", 1) >= 2
    if v2 and (chunks is None or digest_of_chunks(chunks.digests) != shard.header["data_xxh3"]):
        raise ChecksumError(f"{source}: the chunk checksums disagree with the data checksum: "
                            "the shard is corrupt")
    if (skip or v2) and chunks is not None:
        todo = [i for i in range(len(chunks.digests)) if i not in skip]
        runs = batched(todo)
        got_all = map_fn(lambda run: [chunk_checksum(shard, chunks, i) for i in run], runs)
        for i, got in zip(todo, (d for run in got_all for d in run)):
            if got != chunks.digests[i]:
                raise ChecksumError(f"{source}: data checksum mismatch in chunk {i} (stored "
                                    f"{chunks.digests[i]}, computed {got}): the shard is corrupt")
        return
    off = data_offset(shard.header_capacity)
    got = checksum(shard.raw[off: off + shard.layout.data_len])
    if got != shard.header["data_xxh3"]:
        raise ChecksumError(f"{source}: data checksum mismatch (stored "
                            f"{shard.header['data_xxh3']}, computed {got}): the shard is corrupt")


def chunk_checksum(shard: Shard, chunks: Chunks, index: int) -> str:
    """xxh3-64 of data chunk ``index`` of ``shard`` as it is now."""
    at, n = chunks.span(index, shard.layout.data_len)
    return checksum(shard.raw[at: at + n])
