"""Smoke test of ``memckpt bench compare --peers``: memckpt, torchft and DLRover run small (1 MiB
of state, a few steps, no whole-job kill), every row exists and the exactness column is
computed; and a peer that does not import is named with why while the rest runs."""

from __future__ import annotations

import importlib
import json

import pytest

from memckpt.bench.compare import command as compare
from memckpt.bench.compare import peers
from memckpt.bench.compare.report import report

SMALL = peers.PeerSettings(
    state_bytes=2**20, size_label="1M", steps=10, kill_step=4, job_kill_step=4, step_s=0.05,
    whole_job=False,
    # the lighthouse gives a dead group up after 1 s, not 5 s: the run stays short
    torchft=peers.TorchftSettings(join_timeout_ms=1000, heartbeat_timeout_ms=1000))


def _run(which: tuple[str, ...], tmp_path) -> list[dict]:
    return compare.run_compare(compare.CompareSettings(
        parts=(), peers=which, peer_settings=SMALL, directory=str(tmp_path)), log=print)


def _installed() -> tuple[str, ...]:
    """The peers this environment has (``pip install -e '.[peers]'``; not in the test extra:
    DLRover's pynvml makes torch print a FutureWarning on every import of torch.cuda)."""
    have = []
    for peer, module in (("torchft", "torchft"),
                         ("dlrover", "dlrover.trainer.torch.flash_checkpoint.ddp")):
        try:
            importlib.import_module(module)
            have.append(peer)
        except ImportError:
            pass
    return tuple(have)


@pytest.mark.timeout(600)  # about 70 s here with both peers
def test_peers_side_by_side(tmp_path):
    installed = _installed()
    if not installed:
        pytest.skip("no peer installed: pip install -e '.[peers]'")
    rows = _run(installed, tmp_path)
    json.dumps(rows)  # JSON-able, as --json writes them
    by = {r["method"]: r for r in rows}
    assert set(by) == {"memckpt", *installed}, [(r["method"], r.get("error")) for r in rows]
    for m, r in by.items():
        assert r["benchmark"] == "peers" and r["cpu_model"], r
        assert r["blocking_s"] is not None and r["blocking_s"] >= 0, (m, r.get("error"))
        assert r["ram_per_gib"] is not None, (m, r.get("error"))
        assert isinstance(r["kill_exact"], bool), (m, r.get("error"))  # computed, either way
        assert r["kill"]["kill_step"] == SMALL.kill_step
    # memckpt's own guarantee: every rank back at the last snapshot, the same final state
    assert by["memckpt"]["kill_exact"] is True
    assert by["memckpt"]["kill"]["rolled_back_steps"] == 0
    versions = {"torchft": "0.2.0", "dlrover": "0.6.1"}
    assert all(by[p]["version"] == versions[p] for p in installed)
    text = report(rows)
    for m in by:
        assert f"| {m} |" in text


@pytest.mark.timeout(300)
def test_missing_peer_is_named(tmp_path, monkeypatch):
    real = peers._import_module

    def no_dlrover(name: str):
        if name.startswith("dlrover"):
            raise ModuleNotFoundError(f"No module named {name.split('.')[0]!r}")
        return real(name)

    monkeypatch.setattr(peers, "_import_module", no_dlrover)
    status = peers.peer_status(("dlrover",))
    assert status["dlrover"] and "ModuleNotFoundError" in status["dlrover"]
    rows = _run(("dlrover",), tmp_path)
    by = {r["method"]: r for r in rows}
    assert set(by) == {"memckpt", "dlrover"}
    assert by["dlrover"]["error"] == status["dlrover"] and by["dlrover"]["median"] is None
    assert isinstance(by["memckpt"]["kill_exact"], bool)  # the rest ran
    text = report(rows)
    assert "dlrover: NOT measured in full: cannot import" in text and "| memckpt |" in text
