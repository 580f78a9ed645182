"""The persistence tier under the single-process Checkpointer (issue 4), no Ray.

Real files in a temporary directory, a real S3 endpoint (moto's server on a
loopback port, reached through boto3 with an endpoint URL), real processes
(tests/_persist_job.py) killed with real signals. Background work is awaited by
polling its visible result (a manifest, an event) against a deadline.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from queue import Empty, Queue

import boto3
import pytest
import torch

import memckpt
from memckpt.persist import CheckpointStore
from memckpt.persist.manifest import step_folder
from _persist_job import Workload, make_config
from conftest import wait_for
from s3_server import BUCKET, MotoProcess, _free_port, aws_test_env, make_bucket, s3_endpoint  # noqa: F401

HELPER = Path(__file__).with_name("_persist_job.py")
REPO = HELPER.parent.parent
SHARD0 = "rank-00000.shard"


# -- helpers ------------------------------------------------------------------------------------
def persisted_events(ckpt, step: int) -> list[dict]:
    return [e for e in list(ckpt.events) if e["event"] == "persisted" and e["step"] == step]


def wait_persisted(ckpt, step: int, tiers: int = 1, timeout: float = 30.0) -> None:
    """Until ``step`` is committed (manifest written, retention applied) to ``tiers`` tiers."""
    failed = lambda: [e for e in list(ckpt.events) if e["event"] == "persist_failed"]  # noqa: E731
    wait_for(lambda: len(persisted_events(ckpt, step)) >= tiers or failed(), timeout,
             f"step {step} to be persisted", interval=0.01)
    assert not failed(), failed()


def complete_steps(store: CheckpointStore) -> list[int]:
    return [i.step for i in store.list_checkpoints() if i.complete]


def assert_same_tree(a, b, path: str = "") -> None:
    """Bit-exact equality of nested dicts/lists of tensors and scalars."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"tensors differ at {path}"
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            assert_same_tree(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def reference_run(total: int) -> tuple[dict[int, float], dict]:
    """An uninterrupted run without any Checkpointer."""
    w = Workload(0)
    losses = {s: w.train_step(s) for s in range(1, total + 1)}
    return losses, w.final()


@pytest.fixture(scope="module")
def reference():
    return reference_run(12)


@pytest.fixture
def s3_env(s3_endpoint, monkeypatch):
    """The session's moto endpoint, as a job would be pointed at it (also inherited by children)."""
    monkeypatch.setenv("MEMCKPT_S3_ENDPOINT_URL", s3_endpoint)
    return s3_endpoint


def s3_root() -> str:
    return f"s3://{BUCKET}/single-{uuid.uuid4().hex[:10]}"


class Proc:
    """A helper process whose stdout lines are collected by a thread (no pipe stalls)."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env["OMP_NUM_THREADS"] = "1"
        self.p = subprocess.Popen([sys.executable, str(HELPER), *args], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._q: Queue = Queue()
        self._err: list[str] = []
        threading.Thread(target=self._pump, args=(self.p.stdout, self._q), daemon=True).start()
        threading.Thread(target=lambda: self._err.extend(self.p.stderr), daemon=True).start()

    @staticmethod
    def _pump(stream, q: Queue) -> None:
        for line in stream:
            q.put(line.rstrip("\n"))
        q.put(None)

    @property
    def stderr(self) -> str:
        return "".join(self._err)

    def wait_line(self, text: str, timeout: float) -> str:
        """Lines until one equal to ``text`` (or starting with it, then a space)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {text!r} within {timeout} s; got {self.lines[-5:]}; "
                                     f"stderr: {self.stderr[-2000:]}")
            try:
                line = self._q.get(timeout=min(left, 0.5))
            except Empty:
                continue
            if line is None:
                self.p.wait(5)
                raise AssertionError(f"the helper exited ({self.p.returncode}) before {text!r}; "
                                     f"stdout: {self.lines[-5:]}; stderr: {self.stderr[-3000:]}")
            self.lines.append(line)
            if line == text or line.startswith(text + " "):
                return line

    def finish(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the helper did not exit within {timeout} s; "
                                 f"stdout: {self.lines[-5:]}; stderr: {self.stderr[-2000:]}")
        while True:  # the rest of stdout
            try:
                line = self._q.get(timeout=5)
            except Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return rc

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait(10)

    def losses(self) -> dict[int, float]:
        return {int(w[1]): float(w[2]) for w in (x.split() for x in self.lines) if w[0] == "STEP"}


@pytest.fixture
def procs():
    started: list[Proc] = []

    def start(*args: str) -> Proc:
        p = Proc(*args)
        started.append(p)
        return p
    yield start
    for p in started:
        p.kill()


# -- 1. auto-resume from disk / S3 after the RAM is gone ----------------------------------------
@pytest.mark.parametrize("variant", ["local+s3", "s3-only", "local-lost"])
def test_auto_resume_from_persisted_tiers_is_exact(variant, tmp_path, ram_root, s3_env, reference):
    local, s3 = str(tmp_path / "ckpt"), s3_root()
    tiers = {"local+s3": [(local, 2, 3), (s3, 2, 3)], "s3-only": [(s3, 2, 3)],
             "local-lost": [(local, 2, 3), (s3, 2, 3)]}[variant]
    cfg = make_config("single", ram_root, tiers)
    ref_losses, ref_final = reference

    w = Workload(0)
    ckpt = memckpt.Checkpointer(cfg)
    assert ckpt.restore(w.state) == 0
    losses = {}
    for step in range(1, 10):
        losses[step] = w.train_step(step)
        ckpt.step(w.state, step)
    ckpt.close(unlink=True)
    assert not ckpt.directory.exists()  # the RAM snapshots are gone
    for uri, _, _ in tiers:
        store = CheckpointStore(uri)
        assert complete_steps(store)[0] == 8, (uri, store.list_checkpoints())
    assert losses == {s: ref_losses[s] for s in range(1, 10)}

    if variant == "local-lost":  # the fast tier is gone too: resume from the slower one
        shutil.rmtree(local)
    w2 = Workload(1)  # a fresh model with another initial state
    ckpt2 = memckpt.Checkpointer(cfg)
    assert ckpt2.restore(w2.state) == 8
    [restored] = [e for e in ckpt2.events if e["event"] == "restored"]
    expected_tier = local if variant == "local+s3" else s3
    assert restored["source"] == f"{CheckpointStore(expected_tier).describe()}@8", restored
    resumed = {}
    for step in range(9, 13):
        resumed[step] = w2.train_step(step)
        ckpt2.step(w2.state, step)
    ckpt2.close(unlink=True)
    assert resumed == {s: ref_losses[s] for s in range(9, 13)}
    assert_same_tree(w2.final(), ref_final)


# -- 2. the whole process (and its machine's RAM) is lost ---------------------------------------
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigkilled_process_resumes_from_persisted_step(backend, tmp_path, ram_root, s3_env, procs):
    root = str(tmp_path / "ckpt") if backend == "local" else s3_root()
    common = ["--ram-root", ram_root, "--job", "killed", "--tier", root, "--every", "3",
              "--keep", "3"]
    first = procs("train", *common, "--upto", "10", "--pause-after", "7", "--land-each")
    first.wait_line("PAUSED", 60)
    store = CheckpointStore(root)
    wait_for(lambda: store.is_committed(6), 30, "step 6's manifest", interval=0.01)
    first.p.send_signal(signal.SIGKILL)
    assert first.finish(10) == -signal.SIGKILL
    shutil.rmtree(Path(ram_root) / "killed")  # the machine died: its RAM is gone too
    assert complete_steps(store) == [6, 3]

    out = tmp_path / "out"
    second = procs("resume", *common, "--upto", "10", "--out", str(out))
    assert second.finish(90) == 0, second.stderr[-3000:]
    result = json.loads((out / "result.json").read_text())
    reference = {int(k): v for k, v in result["reference"].items()}
    assert result["restored"] == 6
    [restored] = [e for e in result["events"] if e["event"] == "restored"]
    assert restored["source"] == f"{store.describe()}@6"
    assert first.losses() == {s: reference[s] for s in range(1, 8)}
    assert {int(k): v for k, v in result["resumed"].items()} == {s: reference[s] for s in range(7, 11)}
    assert_same_tree(torch.load(out / "resumed.pt", weights_only=True),
                     torch.load(out / "reference.pt", weights_only=True))


# -- 3. a damaged newest checkpoint: fall back and say why --------------------------------------
def _damage(backend: str, root: str, key: str, how: str) -> None:
    if backend == "local":
        path = Path(root, *key.split("/"))
        if how == "flip":
            with open(path, "r+b") as f:
                f.seek(-1, os.SEEK_END)
                b = f.read(1)
                f.seek(-1, os.SEEK_END)
                f.write(bytes([b[0] ^ 0x01]))
        elif how == "truncate":
            os.truncate(path, path.stat().st_size // 2)
        else:
            path.unlink()
        return
    s3 = boto3.client("s3", endpoint_url=os.environ["MEMCKPT_S3_ENDPOINT_URL"],
                      region_name="us-east-1")
    bucket, prefix = root[len("s3://"):].split("/", 1)
    full = f"{prefix}/{key}"
    if how == "delete":
        s3.delete_object(Bucket=bucket, Key=full)
        return
    data = bytearray(s3.get_object(Bucket=bucket, Key=full)["Body"].read())
    if how == "flip":
        data[-1] ^= 0x01
    else:
        del data[len(data) // 2:]
    s3.put_object(Bucket=bucket, Key=full, Body=bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_damaged_newest_checkpoint_falls_back(backend, how, tmp_path, ram_root, s3_env):
    root = str(tmp_path / "ckpt") if backend == "local" else s3_root()
    cfg = make_config("damaged", ram_root, [(root, 2, 3)])
    w = Workload(0)
    ckpt = memckpt.Checkpointer(cfg)
    at4 = None
    for step in range(1, 7):
        w.train_step(step)
        ckpt.step(w.state, step)
        if step % 2 == 0:
            wait_persisted(ckpt, step)
        if step == 4:
            at4 = w.final()
    ckpt.close(unlink=True)
    store = CheckpointStore(root)
    assert complete_steps(store) == [6, 4, 2]

    _damage(backend, root, f"{step_folder(6)}/{SHARD0}", how)
    w2 = Workload(1)
    ckpt2 = memckpt.Checkpointer(cfg)
    assert ckpt2.restore(w2.state) == 4
    assert_same_tree(w2.final(), at4)
    skipped = [e["reason"] for e in ckpt2.events if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and "step 6" in skipped[0], skipped
    why = {"flip": "checksum", "truncate": "truncated", "delete": "missing"}[how]
    assert why in skipped[0], skipped
    ckpt2.close(unlink=True)


# -- 4. the persisting process is killed mid-write ----------------------------------------------
def _all_threads_stopped(pid: int) -> bool:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        states = []
        for t in tasks:
            with open(f"/proc/{pid}/task/{t}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
    except FileNotFoundError:
        return False
    return all(s in "tT" for s in states)


def test_kill_mid_write_leaves_the_partial_checkpoint_invisible(tmp_path, ram_root, procs):
    root = tmp_path / "ckpt"
    common = ["--ram-root", ram_root, "--job", "big", "--tier", str(root)]
    p = procs("big", *common, "--upto", "30")
    p.wait_line("PERSISTED 1", 90)
    pid = p.p.pid

    def freeze_mid_write() -> Path | None:
        """SIGKILL the helper if a shard is between its first byte and its rename: that file."""
        assert p.p.poll() is None, p.stderr[-2000:]
        partial = list(root.glob(f"step-*/.{SHARD0}.tmp-*"))
        if not partial:
            return None
        os.kill(pid, signal.SIGSTOP)
        killed_in = None
        try:
            wait_for(lambda: _all_threads_stopped(pid), 10, "the helper to stop", interval=0.01)
            still = [f for f in partial if f.exists() and not (f.parent / "manifest.json").exists()]
            if still:  # frozen mid-write: the rename has not happened
                os.kill(pid, signal.SIGKILL)
                killed_in = still[0]
        finally:
            if killed_in is None:
                os.kill(pid, signal.SIGCONT)
        return killed_in

    killed_in = wait_for(freeze_mid_write, 60, "a shard write in progress", interval=0.001)
    assert p.finish(10) == -signal.SIGKILL
    shutil.rmtree(Path(ram_root) / "big")  # the RAM copies are gone with the machine

    step = int(killed_in.parent.name.split("-")[1])
    assert step >= 2 and killed_in.exists()  # the partial file is still there ...
    store = CheckpointStore(str(root))
    infos = {i.step: i for i in store.list_checkpoints()}
    if step in infos:  # ... but the step is no checkpoint for any reader
        assert infos[step].complete is False and "no manifest" in infos[step].reason
    assert [s for s, i in infos.items() if i.complete] == [s for s in (step - 1, step - 2) if s >= 1]
    manifest, reasons = store.latest_valid(world_size=1)
    assert manifest.step == step - 1
    assert any(f"step {step}" in r for r in reasons), reasons

    again = procs("big-resume", *common)
    assert again.finish(120) == 0, again.stderr[-3000:]
    assert f"RESTORED {step - 1} EXACT True" in again.lines, again.lines
    assert f"PERSISTED {step}" in again.lines
    # the new commit of that step cleaned the dead writer's temporary file out of its folder
    assert not killed_in.exists()
    assert complete_steps(store)[0] == step


# -- 5. retention -------------------------------------------------------------------------------
def test_retention_keeps_the_newest_and_never_touches_foreign_files(tmp_path, ram_root):
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "notes.txt").write_text("mine")
    (root / "mydata").mkdir()
    (root / "mydata" / SHARD0).write_bytes(b"not memckpt's")
    (root / "step-0000000099-backup").mkdir()
    (root / "step-0000000099-backup" / "manifest.json").write_text("{}")
    cfg = make_config("retain", ram_root, [(str(root), 1, 2)])
    store = CheckpointStore(str(root))
    w = Workload(0)
    ckpt = memckpt.Checkpointer(cfg)
    for step in range(1, 7):
        w.train_step(step)
        ckpt.step(w.state, step)
        wait_persisted(ckpt, step)
        if step == 1:
            (root / step_folder(1) / "README.txt").write_text("keep me")
        assert complete_steps(store) == list(range(step, max(step - 2, 0), -1))
    ckpt.close(unlink=True)

    assert complete_steps(store) == [6, 5]
    assert [i.step for i in store.list_checkpoints()] == [6, 5]
    assert (root / "notes.txt").read_text() == "mine"
    assert (root / "mydata" / SHARD0).read_bytes() == b"not memckpt's"
    assert (root / "step-0000000099-backup" / "manifest.json").read_text() == "{}"
    assert os.listdir(root / step_folder(1)) == ["README.txt"]
    assert (root / step_folder(1) / "README.txt").read_text() == "keep me"
    for s in (2, 3, 4):
        assert not (root / step_folder(s)).exists()
    assert sorted(os.listdir(root / step_folder(6))) == ["manifest.json", SHARD0]


# -- 6. stop file and SIGTERM -------------------------------------------------------------------
def test_stop_file_positive_persists_and_stops(tmp_path, ram_root):
    root, stop = tmp_path / "ckpt", tmp_path / "stop"
    stop.write_text("5\n")
    cfg = make_config("stop-pos", ram_root, [(str(root), 100, 2)], stop_file=str(stop))
    store = CheckpointStore(str(root))
    w = Workload(0)
    ckpt = memckpt.Checkpointer(cfg)
    for step in range(1, 9):
        w.train_step(step)
        ckpt.step(w.state, step)
        if ckpt.should_stop:
            break
        assert complete_steps(store) == []
    assert step == 5
    assert store.is_committed(5) and complete_steps(store) == [5]  # no waiting: step() did it
    ckpt.close(unlink=True)

    w2 = Workload(1)
    ckpt2 = memckpt.Checkpointer(make_config("stop-pos", ram_root, [(str(root), 100, 2)]))
    assert ckpt2.restore(w2.state) == 5
    assert_same_tree(w2.final(), w.final())
    ckpt2.close(unlink=True)


def test_stop_file_negative_persists_once_and_continues(tmp_path, ram_root):
    root, stop = tmp_path / "ckpt", tmp_path / "stop"
    stop.write_text("-4")
    cfg = make_config("stop-neg", ram_root, [(str(root), 100, 2)], stop_file=str(stop))
    store = CheckpointStore(str(root))
    w = Workload(0)
    ckpt = memckpt.Checkpointer(cfg)
    for step in range(1, 10):
        w.train_step(step)
        ckpt.step(w.state, step)
        assert not ckpt.should_stop
        if step == 4:
            assert store.is_committed(4)
        assert complete_steps(store) == ([] if step < 4 else [4]), step
    ckpt.close(unlink=True)
    assert complete_steps(store) == [4]
    assert [e["step"] for e in ckpt.events if e["event"] == "persisted"] == [4]


def test_sigterm_persists_the_newest_step_and_exits_cleanly(tmp_path, ram_root, procs):
    root = tmp_path / "ckpt"
    p = procs("train", "--ram-root", ram_root, "--job", "term", "--tier", str(root),
              "--every", "1000", "--upto", "100000", "--signals", "--step-sleep", "0.02")
    p.wait_line("STEP 3", 60)
    p.p.send_signal(signal.SIGTERM)
    assert p.finish(60) == 0, p.stderr[-3000:]
    assert p.lines[-1] == "DONE"
    stopped = int(p.lines[-2].split()[1])
    assert p.lines[-2] == f"STOPPED {stopped}"
    assert max(p.losses()) == stopped >= 4
    store = CheckpointStore(str(root))
    assert complete_steps(store) == [stopped]


# -- 7. the S3 endpoint goes away and comes back ------------------------------------------------
@pytest.mark.timeout(120)  # two moto server starts: seconds each on a slow, loaded machine
def test_s3_endpoint_down_mid_run_then_back(aws_test_env, ram_root, monkeypatch):  # noqa: F811
    port = _free_port()
    server = MotoProcess(port)
    try:
        bucket = "memckpt-down"
        make_bucket(server.url, bucket)
        monkeypatch.setenv("MEMCKPT_S3_ENDPOINT_URL", server.url)
        root = f"s3://{bucket}/run"
        w = Workload(0)
        ckpt = memckpt.Checkpointer(make_config("s3-down", ram_root, [(root, 1, 2)]))
        store = CheckpointStore(root)
        step = 0

        # Storage never holds a step (tests/test_storage_failures.py measures it, against a
        # twin without persistence and net of CPU waits); max_s here only catches a step
        # hung on storage, generous enough for a slow machine running a whole suite.
        def train_step(max_s: float = 10.0) -> None:
            """One step; ckpt.step must return within max_s and its RAM snapshot seal."""
            nonlocal step
            step += 1
            w.train_step(step)
            t0 = time.perf_counter()
            done = threading.Event()
            threading.Thread(target=lambda: (ckpt.step(w.state, step), done.set()),
                             daemon=True).start()
            assert done.wait(max_s), f"ckpt.step({step}) blocked > {max_s} s: storage stalled training"
            took = time.perf_counter() - t0
            wait_for(lambda: ckpt.engine.steps() and ckpt.engine.steps()[0] == step, max_s - took,
                     f"step {step}'s RAM snapshot to be sealed (the RAM tier must keep going)",
                     interval=0.01)

        for _ in range(3):
            train_step()
            wait_persisted(ckpt, step, timeout=15)
        assert complete_steps(store) == [3, 2]

        server.stop()  # the endpoint is down
        down_from = step

        def retried() -> bool:
            if [e for e in list(ckpt.events) if e["event"] == "persist_retry"]:
                return True
            train_step()
            return False

        wait_for(retried, 15, "a persist_retry event while S3 was down")
        for _ in range(5):
            train_step()
            time.sleep(0.05)
        retries = [e for e in list(ckpt.events) if e["event"] == "persist_retry"]
        assert all(e["step"] > down_from and e["tier"] == root for e in retries), retries
        assert "cannot reach the S3 endpoint" in retries[0]["error"]
        assert not [e for e in ckpt.events if e["event"] == "persisted" and e["step"] > down_from]
        with ckpt.engine.reading(step) as shard:  # the newest RAM snapshot is whole
            assert shard.step == step

        server = MotoProcess(port)  # back on the same port, empty: the bucket is recreated
        make_bucket(server.url, bucket)
        back_from = step
        def resumed() -> bool:
            if [e for e in list(ckpt.events) if e["event"] == "persisted" and e["step"] > back_from]:
                return True
            train_step()
            return False

        wait_for(resumed, 20, "persistence to resume after S3 came back")
        newest = complete_steps(store)[0]
        assert newest > back_from
        ckpt.close(unlink=True)
        assert complete_steps(store)[0] == step  # close() persisted the last step too
    finally:
        server.stop()
