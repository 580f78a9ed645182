"""PyTorch DCP reads memckpt checkpoints: ``dcp.load`` through ``memckpt.dcp_reader`` in
one process without a process group and on 2 ranks over gloo (torchtitan's keys),
from disk and from S3 (moto's server); checksums are verified on every ranged read."""

from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

import memckpt
from memckpt.persist import CheckpointStore
from _procs import spawn
from _reshard_job import commit, dcp_job, merged, write_job
from s3_server import BUCKET, aws_test_env, s3_endpoint  # noqa: F401
from test_reshard import STEPS, run_reshard


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):  # noqa: F811
    monkeypatch.setenv("MEMCKPT_S3_ENDPOINT_URL", s3_endpoint)
    return s3_endpoint


def written(tmp_path: Path, root: str, layout: str, n: int) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    spawn(write_job, n, layout, root, str(tmp_path / "ram-a"), str(out), STEPS)
    commit(root, STEPS, n)
    return out


def assert_same(out: Path, n: int, m: int) -> None:
    before, after = merged(out, "before", n), merged(out, "after", m)
    assert sorted(before) == sorted(after)
    for k in before:
        assert torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("dst", [("single", 1), ("fsdp", 2)])
def test_dcp_load_of_fsdp_checkpoint(tmp_path, dst):
    root = str(tmp_path / "ckpt")
    out = written(tmp_path, root, "fsdp", 3)
    if dst[0] == "single":  # in this process, no process group
        dcp_job(0, 1, 0, "single", root, str(out))
    else:
        spawn(dcp_job, dst[1], dst[0], root, str(out))
    assert_same(out, 3, dst[1])


def test_reader_reads_only_overlapping_ranges_and_verifies(tmp_path):
    root = str(tmp_path / "ckpt")
    written(tmp_path, root, "fsdp", 4)
    reader = memckpt.dcp_reader(root)
    md = reader.read_metadata()
    w = md.state_dict_metadata["model.0.weight"]
    assert tuple(w.size) == (24, 16) and len(w.chunks) == 4  # FSDP2 Shard(0) over 4 ranks
    assert len(md.state_dict_metadata["optim.state.0.weight.step"].chunks) == 1  # replicated
    headers = reader.source.bytes_read
    # one row block of one parameter: a fraction of the shards' bytes
    import torch.distributed.checkpoint as dcp
    target = {"model.0.weight": torch.zeros(24, 16)}
    dcp.load(target, storage_reader=reader, no_dist=True)
    total = sum(e.size for e in CheckpointStore(root).list_checkpoints()[0].manifest.shards)
    assert reader.source.bytes_read - headers < total / 4
    # a flipped byte inside the data is caught by its chunk's checksum
    store = CheckpointStore(root)
    key = store.list_checkpoints()[0].manifest.shard(1).key
    raw = store.backend.get(key)
    h = reader.source.header(1)
    e = h.entries["model/model/0.weight"]
    raw[h.data_offset + e.offset] ^= 0xFF
    store.backend.put(key, raw)
    with pytest.raises(BaseException, match="rank-00001.shard: data checksum mismatch in chunk"):
        dcp.load({"model.0.weight": torch.zeros(24, 16)}, storage_reader=memckpt.dcp_reader(root),
                 no_dist=True)


def test_reshard_from_s3(tmp_path, s3_env):
    run_reshard(tmp_path, f"s3://{BUCKET}/reshard-{uuid.uuid4().hex[:10]}", ("fsdp", 3), ("fsdp", 2))


def test_s3_ranged_read(s3_env):
    store = CheckpointStore(f"s3://{BUCKET}/range-{uuid.uuid4().hex[:10]}")
    data = np.arange(1000, dtype=np.uint8)
    store.backend.put("x/obj", data)
    assert bytes(store.backend.get_range("x/obj", 10, 20)) == bytes(data[10:30])
    assert bytes(store.backend.get_range("x/obj", 990, 20)) == bytes(data[990:])


def test_export_dcp_and_sharded_weights(tmp_path, capsys):
    from safetensors.torch import load_file

    from memckpt.cli.main import main
    root = str(tmp_path / "ckpt")
    out = written(tmp_path, root, "fsdp", 3)
    assert main(["export", root, "--dcp", str(tmp_path / "dcp")]) == 0
    dcp_job(0, 1, 0, "single", str(tmp_path / "dcp"), str(out))  # plain dcp.load
    assert_same(out, 3, 1)
    assert main(["export", root, "--step", str(STEPS), "--weights-only",
                 str(tmp_path / "w.safetensors")]) == 0
    weights = load_file(str(tmp_path / "w.safetensors"))
    before = merged(out, "before", 3)
    assert sorted(weights) == sorted(k.removeprefix("param/") for k in before if k.startswith("param/"))
    for k, v in weights.items():
        assert torch.equal(v, before[f"param/{k}"]), k
