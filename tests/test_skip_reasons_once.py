"""A persisted checkpoint that is passed over on restore is reported once, not once by the
search and again by the caller: the single-process restore logs each reason once, and
``memckpt export`` prints it once."""

from __future__ import annotations

import logging
import shutil

import memckpt
from memckpt.cli import main
from memckpt.persist import CheckpointStore
from memckpt.persist.manifest import step_folder
from _persist_job import Workload, make_config
from test_persist_single import wait_persisted

SHARD0 = "rank-00000.shard"


def _persisted_with_a_partial_newest(tmp_path, ram_root):
    """Steps 2 and 4 committed to a local tier; a step-6 folder holding a shard but no
    manifest (its write never finished)."""
    root = tmp_path / "ckpt"
    cfg = make_config("skip-once", ram_root, [(str(root), 2, 3)])
    w = Workload(0)
    ckpt = memckpt.Checkpointer(cfg)
    for step in range(1, 5):
        w.train_step(step)
        ckpt.step(w.state, step)
        if step % 2 == 0:  # a newer step supersedes one the persister has not started on
            wait_persisted(ckpt, step)
    ckpt.close(unlink=True)
    assert [i.step for i in CheckpointStore(str(root)).list_checkpoints() if i.complete] == [4, 2]
    (root / step_folder(6)).mkdir()
    shutil.copy(root / step_folder(4) / SHARD0, root / step_folder(6) / SHARD0)
    return cfg, root


def test_restore_logs_each_skipped_checkpoint_once(tmp_path, ram_root, caplog):
    cfg, _ = _persisted_with_a_partial_newest(tmp_path, ram_root)
    caplog.set_level(logging.INFO, logger="memckpt")
    ckpt = memckpt.Checkpointer(cfg)
    try:
        assert ckpt.restore(Workload(1).state) == 4
    finally:
        ckpt.close(unlink=True)
    lines = [r.getMessage() for r in caplog.records if step_folder(6) in r.getMessage()]
    assert len(lines) == 1, lines
    assert "step 6" in lines[0] and "no manifest.json" in lines[0]
    skipped = [e["reason"] for e in ckpt.events if e["event"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and step_folder(6) in skipped[0], skipped


def test_export_prints_each_skipped_checkpoint_once(tmp_path, ram_root, capsys, caplog):
    _, root = _persisted_with_a_partial_newest(tmp_path, ram_root)
    caplog.set_level(logging.INFO, logger="memckpt")
    out = tmp_path / "w.safetensors"
    assert main(["export", str(root), "--weights-only", str(out)]) == 0
    err = capsys.readouterr().err
    mentions = [line for line in err.splitlines() if step_folder(6) in line]
    mentions += [r.getMessage() for r in caplog.records if step_folder(6) in r.getMessage()]
    assert len(mentions) == 1, mentions
    assert out.exists()
