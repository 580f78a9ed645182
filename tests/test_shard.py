"""The shard format: layout, zero-copy views, and refusal of every kind of damage."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch
import torch.nn as nn

import memckpt
from memckpt.format import shard as fmt
from memckpt.errors import ChecksumError, StateError
from memckpt.engine.slot import verify_slot


def _region_with(tensors, step=7, header=None):
    layout = fmt.Layout.of(tensors)
    cap = fmt.header_capacity_for(layout)
    region = np.zeros(fmt.region_size(layout, cap), dtype=np.uint8)
    fmt.mark_writing(region)
    views = fmt.tensor_views(torch.from_numpy(region), layout, cap)
    for name, t in tensors:
        views[name].copy_(t)
    digest = fmt.seal(region, layout, cap, step, header or {"meta": {"hello": [1, 2]}})
    return region, layout, cap, digest


def test_layout_is_aligned_and_views_alias_the_region():
    tensors = [("a", torch.arange(5, dtype=torch.float32)), ("b", torch.ones(3, 3, dtype=torch.int8)),
               ("c", torch.tensor(2.5, dtype=torch.float64)), ("d", torch.empty(0, 4))]
    region, layout, cap, digest = _region_with(tensors)
    assert fmt.data_offset(cap) % fmt.DATA_ALIGN == 0
    assert [e.name for e in layout.entries] == ["a", "b", "c", "d"]
    for e in layout.entries:
        assert e.offset % fmt.TENSOR_ALIGN == 0
    assert layout.entries[1].offset == 64 and layout.entries[1].nbytes == 9
    shard = fmt.open_shard(region, "mem")
    assert shard.step == 7 and shard.meta == {"hello": [1, 2]}
    assert shard.header["data_xxh3"] == digest
    for name, t in tensors:
        assert shard.tensors[name].dtype == t.dtype and shard.tensors[name].shape == t.shape
        assert torch.equal(shard.tensors[name], t)
    # zero copy: the views are the region's bytes
    shard.tensors["a"][0] = 42.0
    assert fmt.open_shard(region, "mem", verify=False).tensors["a"][0].item() == 42.0
    with pytest.raises(ChecksumError, match="mem: data checksum mismatch"):
        fmt.open_shard(region, "mem")


def test_unsupported_dtype_is_named():
    with pytest.raises(StateError, match="uint16"):
        fmt.Layout.of([("x", torch.zeros(2, dtype=torch.uint16))])


def test_header_that_outgrew_its_capacity_is_refused_not_truncated():
    tensors = [("a", torch.zeros(4))]
    layout = fmt.Layout.of(tensors)
    cap = fmt.header_capacity_for(layout)
    region = np.zeros(fmt.region_size(layout, cap), dtype=np.uint8)
    fmt.mark_writing(region)
    with pytest.raises(ChecksumError, match="exceeds its reserved"):
        fmt.seal(region, layout, cap, 1, {"meta": {"big": "x" * (cap + 1)}})
    with pytest.raises(ChecksumError, match="incomplete"):
        fmt.open_shard(region, "mem")


# ---- damage to a real shard file written by Checkpointer.save() ---------------------------

class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("ids", torch.arange(100, dtype=torch.int64))


@pytest.fixture
def shard_file(ram_root, tmp_path):
    torch.manual_seed(0)
    model = Small()
    state = memckpt.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ckpt = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root))
    ckpt.step(state, 3)
    path = tmp_path / "step3.shard"
    assert ckpt.save(path) == 3
    yield ckpt, path
    ckpt.close(unlink=True)


def _prefix(path):
    raw = path.read_bytes()
    return fmt.PREFIX.unpack_from(raw, 0)


def _flip(path, offset, mask=0x01):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def _assert_refused(ckpt, path, *patterns):
    """Both restore(source=...) and verify_slot refuse it with a ChecksumError naming it."""
    torch.manual_seed(1)
    victim = Small()
    before = {k: v.clone() for k, v in victim.state_dict().items()}
    state = memckpt.TrainState(model=victim, optimizer=torch.optim.SGD(victim.parameters(), lr=0.1))
    for attempt in (lambda: ckpt.restore(state, source=path), lambda: verify_slot(path)):
        with pytest.raises(ChecksumError) as ei:
            attempt()
        msg = str(ei.value)
        assert str(path) in msg, msg
        for p in patterns:
            assert p in msg, msg
    for k, v in victim.state_dict().items():  # nothing was loaded
        assert torch.equal(v, before[k]), k


def test_intact_file_restores(shard_file):
    ckpt, path = shard_file
    torch.manual_seed(5)
    victim = Small()
    state = memckpt.TrainState(model=victim, optimizer=torch.optim.SGD(victim.parameters(), lr=0.1))
    assert ckpt.restore(state, source=path) == 3
    with ckpt.engine.reading(3) as shard:
        assert torch.equal(victim.lin.weight, shard.tensors["model/model/lin.weight"])
    assert verify_slot(path).step == 3


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_data_byte(shard_file, where):
    ckpt, path = shard_file
    _, _, _, cap, hlen, _, off, dlen, _ = _prefix(path)
    header = json.loads(path.read_bytes()[64: 64 + hlen])
    entries = header["tensors"]
    last = entries[-1]
    pos = {"first": off, "middle": off + dlen // 2, "last": off + last[3] + last[4] - 1}[where]
    _flip(path, pos, 0x80)
    _assert_refused(ckpt, path, "data checksum mismatch")


@pytest.mark.parametrize("pos", [64, 64 + 20, "end"])
def test_flipped_header_byte(shard_file, pos):
    ckpt, path = shard_file
    hlen = _prefix(path)[4]
    _flip(path, 64 + hlen - 1 if pos == "end" else pos, 0x04)
    _assert_refused(ckpt, path, "header checksum mismatch")


@pytest.mark.parametrize("field,offset,pattern", [
    ("magic", 0, "bad magic"),
    ("version", 8, "shard format"),
    ("header_len", 24, ""),
    ("header_sum", 32, "header checksum mismatch"),
    ("data_len", 48, ""),
    ("step", 56, "header disagrees with its prefix"),
])
def test_flipped_prefix_byte(shard_file, field, offset, pattern):
    ckpt, path = shard_file
    _flip(path, offset, 0x02)
    _assert_refused(ckpt, path, pattern)


@pytest.mark.parametrize("keep", ["zero", "in_prefix", "in_header", "at_data", "one_short"])
def test_truncated_file(shard_file, keep):
    ckpt, path = shard_file
    size = path.stat().st_size
    off = _prefix(path)[6]
    n = {"zero": 0, "in_prefix": 40, "in_header": 300, "at_data": off, "one_short": size - 1}[keep]
    with open(path, "r+b") as f:
        f.truncate(n)
    _assert_refused(ckpt, path, "truncated" if n else "")


def test_incomplete_flag_is_refused(shard_file):
    ckpt, path = shard_file
    with open(path, "r+b") as f:
        f.seek(12)
        f.write(struct.pack("<I", fmt.STATE_WRITING))
    _assert_refused(ckpt, path, "incomplete shard")


def test_not_a_shard(shard_file, tmp_path):
    ckpt, _ = shard_file
    other = tmp_path / "model.pt"
    torch.save({"w": torch.zeros(3)}, other)
    _assert_refused(ckpt, other, "not a memckpt shard")


def _as_format_1(region, cap, layout):
    """Rewrite a sealed region as format 1 wrote it: one sequential digest of the data."""
    off = fmt.data_offset(cap)
    header, _, _ = fmt.read_header(region, "mem")
    header.update(format=1, data_xxh3=fmt.checksum(region[off: off + layout.data_len]))
    blob = json.dumps(header, separators=(",", ":")).encode()
    region[fmt.PREFIX.size: fmt.PREFIX.size + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    import xxhash
    fmt.PREFIX.pack_into(region, 0, fmt.MAGIC, 1, fmt.STATE_COMPLETE, cap, len(blob),
                         xxhash.xxh3_64_intdigest(blob), off, layout.data_len, header["step"])


@pytest.mark.parametrize("version", [1, 2])
def test_both_formats_read_and_a_flipped_byte_is_refused(version):
    import concurrent.futures as cf
    g = torch.Generator().manual_seed(0)
    tensors = [("w", torch.randn(300_000, generator=g)), ("b", torch.randn(70_000, generator=g))]
    region, layout, cap, digest = _region_with(tensors)
    if version == 1:
        _as_format_1(region, cap, layout)
    shard = fmt.open_shard(region, "mem")
    assert shard.header["format"] == version and len(shard.chunks.digests) > 4
    with cf.ThreadPoolExecutor(3) as pool:
        fmt.verify_data(shard, "mem", map_fn=pool.map)
        at = fmt.data_offset(cap) + layout.entries[1].offset + 5  # in the last chunks
        region[at] ^= 0x01
        for map_fn in (map, pool.map):
            with pytest.raises(ChecksumError, match="mem: data checksum mismatch"):
                fmt.verify_data(shard, "mem", map_fn=map_fn)
        with pytest.raises(ChecksumError, match="data checksum mismatch"):
            fmt.open_shard(region, "mem")


def test_parallel_seal_writes_the_same_digests_as_one_thread():
    import concurrent.futures as cf
    g = torch.Generator().manual_seed(1)
    tensors = [("w", torch.randn(500_000, generator=g))]
    region, layout, cap, digest = _region_with(tensors)
    again = region.copy()
    with cf.ThreadPoolExecutor(4) as pool:
        assert fmt.seal(again, layout, cap, 7, {"meta": {"hello": [1, 2]}}, pool.map) == digest
    one, four = fmt.open_shard(region, "a"), fmt.open_shard(again, "b")
    assert one.chunks.digests == four.chunks.digests
    off = fmt.data_offset(cap)
    data = region[off: off + layout.data_len]
    assert list(one.chunks.digests) == [fmt.checksum(data[i: i + one.chunks.chunk_bytes])
                                        for i in range(0, len(data), one.chunks.chunk_bytes)]
    assert digest == fmt.digest_of_chunks(one.chunks.digests)


def test_a_lying_chunk_table_is_refused_even_where_every_chunk_matches_it():
    """Format 2 binds the chunk table to data_xxh3: a header whose chunk digests were
    replaced (and its header checksum recomputed) does not verify."""
    region, layout, cap, _ = _region_with([("w", torch.arange(100_000, dtype=torch.float32))])
    header, _, _ = fmt.read_header(region, "mem")
    header["chunk_xxh3"][0] = "0" * 16
    blob = json.dumps(header, separators=(",", ":")).encode()
    region[fmt.PREFIX.size: fmt.PREFIX.size + len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    import xxhash
    fmt.PREFIX.pack_into(region, 0, fmt.MAGIC, 2, fmt.STATE_COMPLETE, cap, len(blob),
                         xxhash.xxh3_64_intdigest(blob), fmt.data_offset(cap), layout.data_len, 7)
    with pytest.raises(ChecksumError, match="chunk checksums disagree"):
        fmt.open_shard(region, "mem")


def test_a_format_this_memckpt_does_not_know_names_the_fix():
    region, *_ = _region_with([("a", torch.zeros(4))])
    struct.pack_into("<I", region, 8, 3)
    with pytest.raises(ChecksumError, match="shard format 3, this memckpt reads 1, 2: upgrade"):
        fmt.open_shard(region, "mem")
