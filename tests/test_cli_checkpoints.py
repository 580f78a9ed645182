"""``memckpt ls ROOT`` and ``memckpt export ROOT --step N --weights-only OUT`` (issue 4).

Real persisted checkpoints (a single-process Checkpointer persisting every step),
on a local directory and on a real S3 endpoint (moto's server on a loopback
port); the commands run through ``memckpt.cli.main`` with their output captured.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import memckpt
from memckpt.cli import main
from memckpt.persist import CheckpointStore
from memckpt.persist.manifest import step_folder
from s3_server import BUCKET, aws_test_env, s3_endpoint  # noqa: F401
from test_persist_single import wait_persisted

SHARD0 = "rank-00000.shard"
ROW = re.compile(r"^\s*(\S+)\s+([\d.]+ MiB)\s+(\S+)\s+(\S+)(?:\s+\((.*)\))?$")


class Tied(nn.Module):
    """An embedding tied to the output layer, a hidden layer and a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 40, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(1.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.emb(x))) * self.scale)


INPUT = torch.arange(40).reshape(5, 8) % 40


def train_and_persist(root: str, ram_root: str, steps: int = 4, keep_last: int = 3) -> dict:
    """Train ``steps`` steps persisting every step; returns {step: (outputs, state_dict)}."""
    torch.manual_seed(0)
    model = Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    cfg = memckpt.Config(job_name="cli", ram_root=ram_root,
                         persistence=(memckpt.PersistTier(root, every=1, keep_last=keep_last),))
    ckpt = memckpt.Checkpointer(cfg)
    seen = {}
    for step in range(1, steps + 1):
        opt.zero_grad()
        model(INPUT).logsumexp(-1).mean().backward()
        opt.step()
        with torch.no_grad():
            model.scale.add_(0.5)
        ckpt.step(memckpt.TrainState(model, opt), step)
        wait_persisted(ckpt, step)
        with torch.no_grad():
            seen[step] = (model(INPUT).clone(),
                          {k: v.clone() for k, v in model.state_dict().items()})
    ckpt.close(unlink=True)
    return seen


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A local root holding complete checkpoints of steps 4, 3, 2 (keep_last=3)."""
    root = tmp_path_factory.mktemp("cli") / "ckpt"
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    ram = tempfile.mkdtemp(prefix="memckpt-cli-", dir=base)
    try:
        seen = train_and_persist(str(root), ram)
    finally:
        shutil.rmtree(ram, ignore_errors=True)
    return root, seen


@pytest.fixture
def root(trained, tmp_path) -> Path:
    """A private copy of the trained root (tests may damage it)."""
    copy = tmp_path / "root"
    shutil.copytree(trained[0], copy)
    return copy


def ls_rows(out: str) -> dict[int, tuple[str, str | None]]:
    rows = {}
    for line in out.splitlines()[1:]:
        m = ROW.match(line)
        assert m, f"unexpected ls line {line!r}"
        rows[int(m.group(1))] = (m.group(3), m.group(5))
    return rows


def flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x80]))


def fresh_model() -> Tied:
    torch.manual_seed(1234)  # another initial state than the trained model's
    return Tied()


# -- ls -----------------------------------------------------------------------------------------
def test_ls_lists_complete_and_incomplete_steps(root, capsys):
    partial = root / step_folder(5)  # a step whose writer died before the manifest
    partial.mkdir()
    shutil.copy(root / step_folder(4) / SHARD0, partial / SHARD0)
    assert main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["step", "size", "status", "folder"]
    rows = ls_rows(out)
    assert list(rows) == [5, 4, 3, 2]
    assert {s: r[0] for s, r in rows.items()} == {5: "incomplete", 4: "complete", 3: "complete",
                                                  2: "complete"}
    assert "no manifest.json" in rows[5][1]
    assert all(r[1] is None for s, r in rows.items() if s != 5)
    assert f"{step_folder(4)}" in out


def test_ls_verify_marks_a_flipped_byte_corrupt(root, capsys):
    flip_last_byte(root / step_folder(3) / SHARD0)
    assert main(["ls", str(root)]) == 0  # the sizes still match: complete without --verify
    assert {s: r[0] for s, r in ls_rows(capsys.readouterr().out).items()} == {
        4: "complete", 3: "complete", 2: "complete"}
    assert main(["ls", str(root), "--verify"]) == 0
    rows = ls_rows(capsys.readouterr().out)
    assert {s: r[0] for s, r in rows.items()} == {4: "verified", 3: "corrupt", 2: "verified"}
    assert "step 3" in rows[3][1] and "checksum" in rows[3][1]


def test_ls_json_parses(root, capsys):
    flip_last_byte(root / step_folder(2) / SHARD0)
    (root / step_folder(4) / "manifest.json").unlink()
    assert main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"], r["folder"]) for r in rows] == [
        (4, "incomplete", step_folder(4)), (3, "complete", step_folder(3)),
        (2, "complete", step_folder(2))]
    assert all(isinstance(r["bytes"], int) and r["bytes"] > 0 for r in rows)
    assert main(["ls", str(root), "--json", "--verify"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [(4, "incomplete"), (3, "verified"),
                                                        (2, "corrupt")]
    assert "checksum" in rows[2]["reason"]


def test_ls_empty_root(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nothing-here")]) == 0
    assert "no checkpoints under" in capsys.readouterr().out
    assert main(["ls", str(tmp_path / "nothing-here"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


# -- export -------------------------------------------------------------------------------------
def _load(path: Path, fmt: str) -> dict[str, torch.Tensor]:
    if fmt == "safetensors":
        from safetensors.torch import load_file
        return load_file(str(path))
    return torch.load(path, weights_only=True)


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_export_weights_only_loads_into_plain_pytorch(fmt, trained, root, tmp_path, capsys):
    _, seen = trained
    out = tmp_path / f"model.{fmt}"
    assert main(["export", str(root), "--step", "3", "--weights-only", str(out)]) == 0
    assert "step 3" in capsys.readouterr().out
    weights = _load(out, fmt)
    outputs, state = seen[3]
    assert set(weights) == set(state)  # both names of the tied weight, and the buffer
    model = fresh_model()
    assert not torch.equal(model(INPUT), outputs)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        assert torch.equal(model(INPUT), outputs)
    for k, v in state.items():
        assert torch.equal(weights[k], v), k


def test_export_defaults_to_the_newest_valid_step(trained, root, tmp_path, capsys):
    _, seen = trained
    flip_last_byte(root / step_folder(4) / SHARD0)  # the newest is corrupt: step 3 it is
    out = tmp_path / "model.safetensors"
    assert main(["export", str(root), "--weights-only", str(out)]) == 0
    assert "step 3" in capsys.readouterr().out
    model = fresh_model()
    model.load_state_dict(_load(out, "safetensors"))
    with torch.no_grad():
        assert torch.equal(model(INPUT), seen[3][0])


def test_export_of_a_missing_step_lists_the_complete_ones(root, tmp_path, capsys):
    out = tmp_path / "model.pt"
    assert main(["export", str(root), "--step", "7", "--weights-only", str(out)]) == 1
    err = capsys.readouterr().err
    assert "step 7" in err and "complete steps: [4, 3, 2]" in err, err
    assert not out.exists()


@pytest.mark.parametrize("argv", [["ls", "s3://Bad_Bucket"],
                                  ["export", "s3://Bad_Bucket", "--weights-only", "x.pt"]])
def test_malformed_root_exits_2_naming_the_fix(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "s3://Bad_Bucket" in err and "ROOT" in err
    assert "s3://bucket/prefix" in err and "lowercase" in err, err


# -- on S3 --------------------------------------------------------------------------------------
def test_ls_and_export_on_s3(s3_endpoint, monkeypatch, ram_root, tmp_path, capsys):  # noqa: F811
    monkeypatch.setenv("MEMCKPT_S3_ENDPOINT_URL", s3_endpoint)
    uri = f"s3://{BUCKET}/cli-{uuid.uuid4().hex[:10]}"
    seen = train_and_persist(uri, ram_root, steps=3, keep_last=2)
    assert main(["ls", uri, "--json", "--verify"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["status"]) for r in rows] == [(3, "verified"), (2, "verified")]
    out = tmp_path / "model.pt"
    assert main(["export", uri, "--step", "2", "--weights-only", str(out)]) == 0
    model = fresh_model()
    model.load_state_dict(torch.load(out, weights_only=True))
    with torch.no_grad():
        assert torch.equal(model(INPUT), seen[2][0])
    assert [i.step for i in CheckpointStore(uri).list_checkpoints()] == [3, 2]
