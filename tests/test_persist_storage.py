"""The persistence storage layer (issue 4): backends, manifests, the checkpoint store, export.

Every store test runs the same body against a local directory and a real S3
endpoint (moto's server on a loopback port, reached through boto3 with an
endpoint URL). Shards are real: a memckpt.Checkpointer snapshots a small torch
model into shared memory and the sealed bytes are persisted.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import tempfile
import uuid

import boto3
import numpy as np
import pytest
import torch
import torch.nn as nn

import memckpt
from memckpt.format import shard as fmt
from memckpt.errors import ChecksumError
from memckpt.persist import (CheckpointStore, LocalBackend, Manifest, ManifestError,
                             ObjectNotFoundError, PersistError, S3Backend, UnsafeKeyError,
                             check_key, export_weights, find_latest, open_backend)
from memckpt.persist import manifest as mf
from s3_server import BUCKET, aws_test_env, make_bucket, s3_endpoint, start_moto  # noqa: F401

WORLD = 2
STEPS = (1, 2, 3, 4, 5, 6)
FP = "fp-test"


class Tiny(nn.Module):
    """Embedding tied to the output layer (an alias in the shard) plus a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 32, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(1.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(x))) * self.scale)


def _shm_dir() -> str:
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix="memckpt-persist-", dir=base)


@pytest.fixture(scope="module")
def run():
    """Real shards of a 2-rank job for steps 1..6: {(step, rank): bytes}, plus weights per step."""
    ram = _shm_dir()
    try:
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        state = memckpt.TrainState(model, opt)
        cfg = memckpt.Config(ram_root=ram, job_name="persist-test")
        ckpts = [memckpt.Checkpointer(cfg, rank=r, world_size=WORLD) for r in range(WORLD)]
        shards, weights = {}, {}
        x = torch.randint(0, 32, (8,))
        for step in STEPS:
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            for r, ck in enumerate(ckpts):
                ck.step(state, step)
                ck.wait()
                with ck.engine.reading(step) as shard:
                    shards[step, r] = bytes(shard.raw)
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
        for ck in ckpts:
            ck.close(unlink=True)
        yield {"shards": shards, "weights": weights, "fingerprint": cfg.fingerprint(), "input": x}
    finally:
        shutil.rmtree(ram, ignore_errors=True)


@pytest.fixture(params=["local", "s3"])
def make_store(request, tmp_path, monkeypatch):
    """A factory of CheckpointStores on one fresh root, local or on the S3 endpoint."""
    if request.param == "local":
        root = str(tmp_path / "ckpt")
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        monkeypatch.setenv("MEMCKPT_S3_ENDPOINT_URL", endpoint)  # how a job would point at it
        root = f"s3://{BUCKET}/t-{uuid.uuid4().hex[:10]}"

    def make(keep_last: int = 2, two_slot: bool = False) -> CheckpointStore:
        return CheckpointStore(memckpt.PersistTier(root, keep_last=keep_last, two_slot=two_slot))
    make.root = root
    return make


def persist(store: CheckpointStore, run, step: int, ranks=range(WORLD), commit: bool = True,
            replace: bool = False):
    entries = [store.write_shard(step, r, run["shards"][step, r], replace=replace) for r in ranks]
    if commit:
        return store.commit(step, WORLD, entries, fingerprint=run["fingerprint"],
                            placement={"strategy": "ring", "holders": {"0": [1], "1": [0]}},
                            job="persist-test")
    return entries


def complete_steps(store: CheckpointStore) -> list[int]:
    return [i.step for i in store.list_checkpoints() if i.complete]


# -- round trip, manifest last ----------------------------------------------------------------
def test_write_commit_find_and_read_round_trip(make_store, run):
    store = make_store()
    m = persist(store, run, 1)
    assert (m.step, m.world_size, m.fingerprint, m.job) == (1, WORLD, run["fingerprint"], "persist-test")
    assert [e.key for e in m.shards] == ["step-0000000001/rank-00000.shard",
                                         "step-0000000001/rank-00001.shard"]
    assert m.memckpt_version == memckpt.__version__

    again = make_store()  # a new job on the same root
    found, reasons = again.latest_valid(world_size=WORLD, fingerprint=run["fingerprint"])
    assert reasons == [] and found == m
    for r in range(WORLD):
        region = again.read_shard(found, r)
        assert region.tobytes() == run["shards"][1, r]
        shard = fmt.open_shard(region, "test")
        assert (shard.step, shard.header["rank"]) == (1, r)
    [info] = again.list_checkpoints()
    assert (info.step, info.complete, info.reason, info.folder) == (1, True, None, "step-0000000001")
    assert info.bytes == m.nbytes + len(m.to_json())
    assert again.backend.list("step-0000000001/") == [
        "step-0000000001/manifest.json", "step-0000000001/rank-00000.shard",
        "step-0000000001/rank-00001.shard"]


class Recording:
    """A backend proxy that records every mutating call, in order."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("put", "delete", "delete_many"):
            def wrapped(key, *a, **kw):
                self.calls.append((name, key if isinstance(key, str) else list(key)))
                return attr(key, *a, **kw)
            return wrapped
        return attr


def test_manifest_is_written_last_and_a_step_without_it_is_invisible(make_store, run):
    base = make_store()
    rec = Recording(base.backend)
    store = CheckpointStore(base.uri, keep_last=5, backend=rec)
    persist(store, run, 1)
    manifest = "step-0000000001/manifest.json"
    puts = [k for op, k in rec.calls if op == "put"]
    assert puts[-1] == manifest and puts.count(manifest) == 1
    assert store.is_committed(1) and not store.is_committed(2)
    # a committed step is not rewritten by accident (a kill mid-rewrite would lose it) ...
    with pytest.raises(PersistError, match="already committed"):
        store.write_shard(1, 0, run["shards"][1, 0])
    # ... but can be on purpose: its manifest goes first, the new one comes last
    rec.calls.clear()
    persist(store, run, 1, ranks=[0], commit=False, replace=True)
    assert rec.calls == [("delete", manifest), ("put", "step-0000000001/rank-00000.shard")]
    assert not store.is_committed(1)
    persist(store, run, 1)

    persist(store, run, 2, commit=False)  # every shard of step 2 written, the job died before commit
    assert base.backend.exists("step-0000000002/rank-00001.shard")
    found, reasons = make_store().latest_valid(world_size=WORLD)
    assert found.step == 1
    assert len(reasons) == 1 and "step 2" in reasons[0] and "no manifest" in reasons[0]
    infos = {i.step: i for i in store.list_checkpoints()}
    assert infos[2].complete is False and "no manifest" in infos[2].reason
    assert infos[1].complete is True


_WRITER = r"""
import os, sys, time
from memckpt.persist import CheckpointStore
root, shards = sys.argv[1], sys.argv[2:]
store = CheckpointStore(root, keep_last=2)
store.write_shard(2, 0, open(shards[0], "rb").read())
def stuck(fd):  # the second shard's bytes are in its temporary file; the rename never comes
    print("IN_FSYNC", flush=True)
    time.sleep(600)
os.fsync = stuck
store.write_shard(2, 1, open(shards[1], "rb").read())
"""


def test_killed_mid_write_leaves_an_invisible_partial_checkpoint(tmp_path, run):
    import signal
    import subprocess
    import sys

    root = tmp_path / "ckpt"
    store = CheckpointStore(str(root), keep_last=2)
    persist(store, run, 1)
    files = []
    for r in range(WORLD):
        files.append(tmp_path / f"s{r}")
        files[-1].write_bytes(run["shards"][2, r])
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(root), *map(str, files)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "IN_FSYNC"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert [p.name for p in (root / "step-0000000002").iterdir() if ".tmp-" in p.name]
    found, reasons = CheckpointStore(str(root)).latest_valid(world_size=WORLD)
    assert found.step == 1 and "step 2" in reasons[0]
    assert found == store.latest_valid()[0]
    persist(store, run, 3)  # the partial step 2 (and its temporary file) is cleaned up
    assert not (root / "step-0000000002").exists()
    assert complete_steps(store) == [3, 1]


# -- corruption: fall back to the previous checkpoint and say why ---------------------------------
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_truncated_or_missing_shard_falls_back_with_reason(make_store, run, damage):
    store = make_store(keep_last=3)
    persist(store, run, 1)
    m2 = persist(store, run, 2)
    key = m2.shard(1).key
    data = store.backend.get(key)
    if damage == "flip":
        data[len(data) - 7] ^= 0x01  # a byte in the tensor data
        store.backend.put(key, data)
    elif damage == "truncate":
        store.backend.put(key, data[: len(data) - 1000])
    else:
        store.backend.delete(key)

    found, reasons = make_store().latest_valid(world_size=WORLD, fingerprint=run["fingerprint"])
    assert found is not None and found.step == 1
    assert len(reasons) == 1
    why = reasons[0]
    assert "step 2" in why and "rank 1" in why, why
    expect = {"flip": "checksum mismatch", "truncate": "bytes", "delete": "missing"}[damage]
    assert expect in why, why
    with pytest.raises(ChecksumError, match="rank-00001"):
        store.read_shard(m2, 1)
    assert store.read_shard(m2, 0).tobytes() == run["shards"][2, 0]  # the intact rank still reads


def test_flipped_byte_in_the_shard_header_or_manifest_is_caught(make_store, run):
    store = make_store(keep_last=3)
    persist(store, run, 1)
    persist(store, run, 2)
    m3 = persist(store, run, 3)
    key = m3.shard(0).key
    data = store.backend.get(key)
    data[70] ^= 0x20  # inside the JSON header
    store.backend.put(key, data)
    text = bytearray(store.backend.get("step-0000000002/manifest.json").tobytes())
    i = text.index(b'"job"')
    text[i + 1] = ord("J")  # "Job": still valid JSON, wrong checksum
    store.backend.put("step-0000000002/manifest.json", bytes(text))
    found, reasons = store.latest_valid()
    assert found.step == 1
    assert "step 3, rank 0" in reasons[0] and "header checksum mismatch" in reasons[0]
    assert "step 2" in reasons[1] and "manifest checksum mismatch" in reasons[1]


# -- retention -------------------------------------------------------------------------------------
def test_retention_keeps_last_n_and_never_touches_foreign_files(make_store, run):
    store = make_store(keep_last=2)
    b = store.backend
    foreign = {
        "notes.txt": b"mine",
        "step-0000000001/README.user": b"a user's file inside a memckpt folder",
        "step-0000000001-backup/rank-00000.shard": run["shards"][1, 0],
        "step-12/manifest.json": b"{}",
        "other/step-0000000001/manifest.json": b"{}",
        "slot-c/rank-00000.shard": b"x" * 100,
    }
    for k, v in foreign.items():
        b.put(k, v)
    persist(store, run, 1)
    persist(store, run, 2)
    assert complete_steps(store) == [2, 1]
    persist(store, run, 3, commit=False)  # a crashed write, older than what comes next
    persist(store, run, 6, ranks=[0], commit=False)  # a newer partial folder (left by a crash)
    persist(store, run, 4)
    assert complete_steps(store) == [4, 2]
    steps = {i.step: i for i in store.list_checkpoints()}
    assert 3 not in steps, "the partial folder older than the newest complete one is cleaned up"
    assert steps[6].complete is False, "a newer partial folder is left alone"
    persist(store, run, 5)
    assert complete_steps(store) == [5, 4]
    keys = set(b.list())
    for k, v in foreign.items():
        assert k in keys and b.get(k).tobytes() == v, k
    # step 1's files are gone, the user's file and so its folder are kept
    assert [k for k in keys if k.startswith("step-0000000001/")] == ["step-0000000001/README.user"]
    if isinstance(b, LocalBackend):
        assert not (b.root / "step-0000000002").exists(), "emptied folders are removed"
        assert not [p for p in b.root.rglob("*.tmp-*")], "no temporary files are left"
    found, _ = store.latest_valid(world_size=WORLD)
    assert found.step == 5


def test_retention_leaves_another_jobs_checkpoints_alone(make_store, run):
    store = make_store(keep_last=1)
    entries = persist(store, run, 6, commit=False)
    store.commit(6, WORLD, entries, fingerprint="another-config", job="old-job")
    persist(store, run, 1)
    persist(store, run, 2)  # a newer step of another job must not push our commit out
    assert complete_steps(store) == [6, 2]
    found, reasons = store.latest_valid(world_size=WORLD, fingerprint=run["fingerprint"])
    assert found.step == 2 and "another-config" in reasons[0]


def test_retention_never_deletes_the_only_complete_checkpoint(make_store, run):
    store = make_store(keep_last=1)
    persist(store, run, 1)
    persist(store, run, 2, ranks=[0], commit=False)  # the next write dies half-way
    assert store.apply_retention() == []
    assert complete_steps(store) == [1]
    found, reasons = store.latest_valid(world_size=WORLD)
    assert found.step == 1 and "step 2" in reasons[0]
    persist(store, run, 3)  # only now may step 1 go
    assert complete_steps(store) == [3]
    assert [i.step for i in store.list_checkpoints()] == [3]


# -- two-slot mode ---------------------------------------------------------------------------------
def test_two_slot_alternates_between_two_fixed_folders(make_store, run):
    base = make_store(two_slot=True)
    rec = Recording(base.backend)
    store = CheckpointStore(base.uri, two_slot=True, backend=rec)
    assert store.folder_for(1) == "slot-a"
    assert persist(store, run, 1).folder == "slot-a"
    assert persist(store, run, 2).folder == "slot-b"
    assert persist(store, run, 3).folder == "slot-a"
    assert {(i.folder, i.step, i.complete) for i in store.list_checkpoints()} == {
        ("slot-a", 3, True), ("slot-b", 2, True)}
    # the next step goes to slot-b: its manifest is removed before any shard is overwritten
    assert store.folder_for(4) == "slot-b"
    rec.calls.clear()
    persist(store, run, 4, ranks=[0], commit=False)
    assert rec.calls == [("delete", "slot-b/manifest.json"), ("put", "slot-b/rank-00000.shard")]
    assert not store.backend.exists("slot-b/manifest.json")
    assert store.folder_for(4) == "slot-b", "a partial slot does not flip the choice"
    found, reasons = make_store(two_slot=True).latest_valid(world_size=WORLD)
    assert found.step == 3 and "slot-b" in reasons[0] and "no manifest" in reasons[0]
    persist(store, run, 4)
    persist(store, run, 5)
    assert {(i.folder, i.step) for i in store.list_checkpoints()} == {("slot-a", 5), ("slot-b", 4)}
    assert sorted({k.split("/")[0] for k in store.backend.list()}) == ["slot-a", "slot-b"]
    assert store.latest_valid(world_size=WORLD)[0].step == 5
    with pytest.raises(ManifestError, match="two-slot"):
        store.write_shard(6, 0, run["shards"][6, 0], folder="step-0000000006")


# -- safety: manifests naming paths outside the root --------------------------------------------------
def _forged(manifest: Manifest, **changes) -> str:
    body = json.loads(manifest.to_json())
    body.pop("manifest_xxh3")
    for k, v in changes.items():
        if k == "key":
            body["shards"][1]["key"] = v
        else:
            body[k] = v
    body["manifest_xxh3"] = mf._digest(body)  # a well-formed, correctly checksummed forgery
    return json.dumps(body)


@pytest.mark.parametrize("bad", ["../../etc/passwd", "/etc/passwd", "step-0000000002\\..\\x",
                                 "step-0000000002/../step-0000000001/rank-00001.shard",
                                 "other/rank-00001.shard", "step-0000000002//rank-00001.shard",
                                 "step-0000000002/sub/rank-00001.shard"])
def test_manifest_paths_escaping_the_folder_are_rejected(make_store, run, bad):
    store = make_store(keep_last=3)
    persist(store, run, 1)
    m2 = persist(store, run, 2)
    store.backend.put("step-0000000002/manifest.json", _forged(m2, key=bad).encode())
    found, reasons = store.latest_valid(world_size=WORLD)
    assert found.step == 1
    assert "step 2" in reasons[0] and "refusing this manifest" in reasons[0], reasons
    with pytest.raises(UnsafeKeyError):
        Manifest.from_json(_forged(m2, key=bad), "forged", "step-0000000002")


def test_keys_are_checked_by_every_backend(make_store):
    b = make_store().backend
    for bad in ["../x", "/abs", "a/../b", "a\\b", "a//b", "a/", "", "./a", "C:/x", "a\x00b"]:
        with pytest.raises(UnsafeKeyError):
            b.put(bad, b"x")
        with pytest.raises(UnsafeKeyError):
            b.get(bad)
        with pytest.raises(UnsafeKeyError):
            b.delete(bad)
    assert check_key("step-0000000001/rank-00000.shard")
    with pytest.raises(ObjectNotFoundError):
        b.get("absent/key")
    assert b.exists("absent/key") is False
    b.delete("absent/key")  # no error


def test_local_backend_refuses_a_symlink_out_of_its_root(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"s")
    root = tmp_path / "root"
    root.mkdir()
    (root / "step-0000000001").symlink_to(outside)
    b = LocalBackend(root)
    with pytest.raises(UnsafeKeyError, match="symlink"):
        b.get("step-0000000001/secret")
    with pytest.raises(UnsafeKeyError):
        b.delete("step-0000000001/secret")
    assert (outside / "secret").exists()
    assert b.list() == []


def test_manifest_validation(run):
    entries = [mf.ShardEntry(r, f"step-0000000003/rank-{r:05d}.shard", 8192, "0123456789abcdef")
               for r in range(3)]
    m = Manifest(step=3, world_size=3, fingerprint="f", shards=tuple(reversed(entries)),
                 placement={"k": [1]}, memckpt_version="0.1.0", created_at=1.5, job="j")
    assert [e.rank for e in m.shards] == [0, 1, 2]
    assert Manifest.from_json(m.to_json(), "x", "step-0000000003") == m
    with pytest.raises(ManifestError, match="ranks \\[2\\]"):
        Manifest(step=3, world_size=3, fingerprint="f", shards=tuple(entries[:2]))
    with pytest.raises(ManifestError, match="listed twice"):
        Manifest(step=3, world_size=2, fingerprint="f", shards=(entries[0], entries[0]))
    with pytest.raises(ManifestError, match="out of range"):
        Manifest(step=3, world_size=2, fingerprint="f", shards=(entries[0], entries[2]))
    with pytest.raises(ManifestError, match="folder"):
        Manifest.from_json(m.to_json(), "x", "step-0000000004")
    for field, value in [("step", "3"), ("world_size", True), ("fingerprint", 7), ("created_at", "now"),
                         ("placement", [])]:
        with pytest.raises(ManifestError, match=field):
            Manifest.from_json(_forged(m, **{field: value}), "x", "step-0000000003")
    with pytest.raises(ManifestError, match="not valid JSON"):
        Manifest.from_json("{", "x")


# -- refusing a checkpoint of another job shape ---------------------------------------------------------
def test_different_world_size_or_model_is_refused_saying_what_differs(make_store, run):
    store = make_store()
    persist(store, run, 1)
    found, reasons = store.latest_valid(world_size=4, fingerprint=run["fingerprint"])
    assert found is None
    assert "written by 2 ranks, this job has 4" in reasons[0] and "world size differs" in reasons[0]
    found, reasons = store.latest_valid(world_size=WORLD, fingerprint="another")
    assert found is None and "fingerprint" in reasons[0] and "another" in reasons[0]
    assert store.latest_valid(world_size=WORLD, fingerprint=run["fingerprint"])[0].step == 1


def test_find_latest_across_tiers(tmp_path, s3_endpoint, run):
    disk = CheckpointStore(str(tmp_path / "disk"), keep_last=3)
    s3 = CheckpointStore(f"s3://{BUCKET}/tiers-{uuid.uuid4().hex[:8]}", keep_last=3,
                         endpoint_url=s3_endpoint)
    persist(disk, run, 1)
    persist(disk, run, 2)
    m3 = persist(s3, run, 3)
    s3.backend.delete(m3.shard(0).key)
    store, found, reasons = find_latest([disk, s3], WORLD, run["fingerprint"])
    assert store is disk and found.step == 2
    assert reasons[0].startswith(s3.describe()) and "step 3" in reasons[0] and "missing" in reasons[0]
    persist(s3, run, 2)  # a tie: the first-listed tier wins
    assert find_latest([disk, s3], WORLD, run["fingerprint"])[0] is disk
    persist(s3, run, 4)
    store, found, reasons = find_latest([disk, s3], WORLD, run["fingerprint"])
    assert store is s3 and found.step == 4 and reasons == []
    assert find_latest([], WORLD, None) == (None, None, [])


# -- S3 specifics ---------------------------------------------------------------------------------------
def test_s3_multipart_upload_of_a_large_shard(s3_endpoint, ram_root):
    torch.manual_seed(1)
    model = nn.Linear(1024, 2816)  # ~11.5 MB of parameters: three 5 MiB parts
    state = memckpt.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ck = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, job_name="big"))
    ck.step(state, 1)
    ck.wait()
    with ck.engine.reading(1) as shard:
        data = np.array(shard.raw)
    ck.close(unlink=True)
    uri = f"s3://{BUCKET}/big-{uuid.uuid4().hex[:8]}"
    store = CheckpointStore(uri, endpoint_url=s3_endpoint, multipart_threshold=1 << 20,
                            multipart_chunksize=5 << 20, max_concurrency=4)
    assert len(data) > 2 * (5 << 20)
    entry = store.write_shard(1, 0, data)
    store.commit(1, 1, [entry], fingerprint="f")
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    prefix = uri.split("/", 3)[3]
    etag = client.head_object(Bucket=BUCKET, Key=f"{prefix}/{entry.key}")["ETag"].strip('"')
    assert etag.endswith("-3"), f"expected a 3-part multipart upload, ETag {etag}"
    found, reasons = store.latest_valid(world_size=1)
    assert found.step == 1 and reasons == []
    assert np.array_equal(store.read_shard(found, 0), data)


def test_stopped_s3_endpoint_raises_retryable_error_naming_the_uri(aws_test_env):
    server, url = start_moto()
    try:
        make_bucket(url, "down-bucket")
        b = S3Backend("s3://down-bucket/ckpt", endpoint_url=url, max_attempts=1, connect_timeout=1)
        b.put("step-0000000001/rank-00000.shard", b"x" * 100)
        assert b.get("step-0000000001/rank-00000.shard").tobytes() == b"x" * 100
    finally:
        server.stop()
    for call in (lambda: b.put("step-0000000001/manifest.json", b"{}"),
                 lambda: b.get("step-0000000001/rank-00000.shard"),
                 lambda: b.list(), lambda: b.exists("k")):
        with pytest.raises(PersistError) as info:
            call()
        err = info.value
        assert err.retryable is True
        assert "s3://down-bucket/ckpt" in err.message and url in err.message
        assert "endpoint" in err.message and "testing" not in err.message  # no credentials
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is type(err) and again.retryable and again.message == err.message


def test_s3_configuration_errors_are_not_retryable(s3_endpoint):
    missing = S3Backend("s3://no-such-bucket-here/x", endpoint_url=s3_endpoint, max_attempts=1)
    with pytest.raises(PersistError) as info:
        missing.put("k", b"1")
    assert info.value.retryable is False and "no-such-bucket-here" in info.value.message
    assert "does not exist" in info.value.message
    b = pickle.loads(pickle.dumps(S3Backend(f"s3://{BUCKET}/p", endpoint_url=s3_endpoint)))
    b.put("a/b", np.arange(10, dtype=np.uint8))  # a pickled backend (sent to an actor) works
    assert b.get("a/b").tolist() == list(range(10)) and b.list("a/") == ["a/b"]
    assert b.describe() == f"s3://{BUCKET}/p"
    assert isinstance(open_backend(f"s3://{BUCKET}/p"), S3Backend)
    with pytest.raises(PersistError, match="not a valid S3 URI"):
        S3Backend("s3://Bad_Bucket/x")


def test_local_backend_errors_name_the_path(tmp_path):
    root = tmp_path / "file-not-dir"
    root.write_bytes(b"")
    b = open_backend(str(root))
    assert isinstance(b, LocalBackend) and b.describe() == str(root)
    with pytest.raises(PersistError) as info:
        b.put("step-0000000001/rank-00000.shard", b"x")
    assert str(root) in info.value.message and info.value.retryable is False
    with pytest.raises(PersistError, match="unsupported scheme"):
        open_backend("gs://bucket/x")


# -- weights-only export ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["safetensors", "pt"])
def test_export_weights_loads_into_a_fresh_model(make_store, run, tmp_path, kind):
    from safetensors.torch import load_file

    store = make_store()
    m = persist(store, run, 3)
    out = tmp_path / f"model.{kind}"
    keys = export_weights(m, out, fmt=kind, store=store)
    assert sorted(keys) == sorted(run["weights"][3])
    sd = load_file(str(out)) if kind == "safetensors" else torch.load(out, weights_only=True)
    assert set(sd) == {"emb.weight", "hidden.weight", "hidden.bias", "out.weight", "scale"}
    fresh = Tiny()
    fresh.load_state_dict(sd)
    assert fresh.out.weight is fresh.emb.weight
    reference = Tiny()
    reference.load_state_dict(run["weights"][3])
    x = run["input"]
    assert torch.equal(fresh(x), reference(x))
    for k, v in run["weights"][3].items():
        assert torch.equal(sd[k], v), k


def test_export_from_ram_shard_and_bytes_and_several_models(ram_root, tmp_path):
    torch.manual_seed(2)
    a, b = Tiny(), nn.Linear(4, 3)
    state = memckpt.TrainState({"a": a, "b": b})
    ck = memckpt.Checkpointer(memckpt.Config(ram_root=ram_root, job_name="export"))
    ck.step(state, 7)
    ck.wait()
    with ck.engine.reading(7) as shard:
        keys = export_weights(shard, tmp_path / "both.pt", fmt="pt")
        raw = bytes(shard.raw)
    ck.close(unlink=True)
    assert "a.emb.weight" in keys and "b.weight" in keys
    sd = torch.load(tmp_path / "both.pt", weights_only=True)
    assert torch.equal(sd["b.bias"], b.bias.detach())
    export_weights(raw, tmp_path / "a.safetensors", model="a")
    from safetensors.torch import load_file
    fresh = Tiny()
    fresh.load_state_dict(load_file(str(tmp_path / "a.safetensors")))
    x = torch.arange(5)
    assert torch.equal(fresh(x), a(x))
    broken = bytearray(raw)
    broken[-3] ^= 1
    with pytest.raises(ChecksumError):
        export_weights(bytes(broken), tmp_path / "never.safetensors")
    assert not (tmp_path / "never.safetensors").exists()
