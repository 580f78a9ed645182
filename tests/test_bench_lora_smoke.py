"""Smoke test of ``memckpt bench lora`` at the tiny size: every row, what each copies and sends
(byte counts, never timings), and a snapshot that skipped the frozen base restores the live
state bit for bit into a job built with other weights."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("transformers")

from memckpt.bench.common import machine_info  # noqa: E402
from memckpt.bench.lora.llama import PRESETS, LoraJob  # noqa: E402
from memckpt.bench.lora.measure import LoraBench  # noqa: E402
from memckpt.bench.lora.report import report  # noqa: E402
from memckpt.bench.lora.rows import derive  # noqa: E402
from memckpt.cli import main  # noqa: E402
from memckpt.format.state import TrainState  # noqa: E402

pytestmark = pytest.mark.timeout(120)
STEPS = 3


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def test_rows_bytes_and_the_restored_step_is_the_live_state():
    with LoraBench("tiny", seed=0) as bench:
        bench.run(STEPS)
        assert bench.frozen_share >= 0.9
        rows = derive(bench.measured(), "tiny", bench.state_bytes, bench.frozen_share,
                      machine_info())
        by = {r.variant: r for r in rows}
        assert list(by) == ["verify", "trust", "off", "trainable"]
        for r in rows:
            assert r.steps == STEPS and r.blocked_s > 0 and r.sent_bytes > 0, r
        # the frozen base once in each place; "off" copies it into both own slots, and its
        # holder still shares it (a holder shares by checksum, whatever the sender copied)
        for r in (by["verify"], by["trust"], by["off"]):
            assert r.holder_bytes < 1.2 * r.state_bytes, r
        for r in (by["verify"], by["trust"]):
            assert r.ram_bytes < 1.2 * r.state_bytes and r.held_over_state < 2.3, r
        assert by["off"].ram_bytes >= 2 * by["off"].state_bytes
        off, alone = by["off"], by["trainable"]
        assert off.copied_bytes == off.state_bytes == bench.state_bytes
        assert alone.copied_bytes == alone.state_bytes < off.state_bytes / 10
        for name in ("verify", "trust"):
            r = by[name]
            # the frozen base is left in its slot: what changed is exactly the trainable part
            assert r.copied_bytes == alone.copied_bytes, r
            assert r.unchanged_bytes == r.state_bytes - r.copied_bytes
            # the holder takes only the chunks that changed (off's too: it reuses chunks by
            # checksum whatever skip_unchanged says)
            assert r.sent_bytes <= off.sent_bytes and r.sent_bytes < r.shard_bytes / 4, r
        text = report(rows, "tiny job")
        assert "| trainable part alone |" in text and "targets:" in text

        for name in ("verify", "trust"):
            variant, step = bench.variants[name], bench.step
            other = LoraJob(PRESETS["tiny"], seed=1)  # other base weights, no AdamW moments yet
            state = TrainState(model=other.model, optimizer=other.optimizer)
            with variant.ckpt.engine.reading(step, verify=True) as shard:
                assert state.load(shard.tensors, shard.meta) == step
            live = dict(variant.state.capture(step).tensors)
            restored = dict(state.capture(step).tensors)
            assert live.keys() == restored.keys()
            for key, t in live.items():
                got = restored[key]
                assert (got.dtype, got.shape) == (t.dtype, t.shape), key
                assert torch.equal(_bits(got), _bits(t)), f"{name}: {key} differs"


def test_the_command_writes_json_rows_and_the_table(tmp_path, capsys):
    out = tmp_path / "rows.json"
    assert main(["bench", "lora", "--size", "tiny", "--steps", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["variant"] for r in rows] == ["verify", "trust", "off", "trainable"]
    assert all(r["benchmark"] == "lora" and r["steps"] == 2 for r in rows)
    assert rows[2]["blocked_vs_off"] == pytest.approx(1.0)
    assert rows[3]["blocked_vs_trainable"] == pytest.approx(1.0)
    printed = capsys.readouterr()
    assert "| checkpointer |" in printed.out and "frozen base" in printed.err
