"""The single-process demo (`memckpt demo --local`) and the demo workload (no Ray)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

from memckpt import cli
from memckpt.demo.model import (GPT, MINI, PRESETS, SMALL, TINY, build, count_parameters,
                                 digest, state_digest)


# ---- the demo end to end (three real processes, one SIGKILLed) -----------------------------

def test_local_demo_resumes_bit_identically(tmp_path, capsys):
    summary = tmp_path / "out" / "summary.json"
    rc = cli.main(["demo", "--local", "--tiny", "--steps", "8", "--kill-at", "3",
                   "--summary", str(summary)])
    out = capsys.readouterr().out
    assert rc == 0, out
    doc = json.loads(summary.read_text())
    assert doc["identical"] is True
    assert len(doc["losses"]) == len(doc["reference_losses"]) == 8
    for step, (got, want) in enumerate(zip(doc["losses"], doc["reference_losses"]), 1):
        assert got == want, f"step {step}: {got!r} != {want!r}"
    assert doc["losses"][-1] < doc["losses"][0]  # it does learn
    assert len(doc["final_digest"]) == 64 and doc["final_digest"] == doc["reference_digest"]
    [rec] = doc["recoveries"]
    assert rec["source"] == "ram" and rec["signal"] == "SIGKILL"
    assert rec["killed_after_step"] == 3 and rec["resumed_step"] == 3
    assert 0 <= rec["restore_seconds"] < 30
    assert "killed at step 3 (SIGKILL), restored step 3 from RAM" in out
    assert "losses identical: yes; final digest identical: yes" in out
    # the RAM snapshots are cleaned up
    leftovers = [p for base in (Path("/dev/shm"), Path(tempfile.gettempdir())) if base.is_dir()
                 for p in base.glob(f"memckpt-demo-{os.getpid()}-*")]
    assert leftovers == []


@pytest.mark.parametrize("argv", [
    ["--kill-at", "8", "--steps", "8"],   # must stop before the last step
    ["--kill-at", "0"],                   # steps are counted from 1
    ["--kill-at", "x"],
    ["--steps", "1"],
    ["--tiny", "--size", "mini"],
    ["--model", "fsdp"],                  # the FSDP2 demo is the multi-node one
    ["--model", "megatron"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--local", *argv])
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


# ---- the workload -------------------------------------------------------------------------

def test_lm_head_is_tied_to_the_token_embedding():
    model = GPT(TINY)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names and "lm_head.weight" not in names  # counted once


def test_parameter_counts():
    assert 10_000_000 <= count_parameters(SMALL) <= 50_000_000
    assert 50_000 <= count_parameters(TINY) <= 200_000
    assert count_parameters(MINI) < count_parameters(SMALL)
    for cfg in (TINY, MINI):  # the closed form agrees with the module
        assert GPT(cfg).num_parameters() == count_parameters(cfg)
    assert set(PRESETS) == {"tiny", "mini", "small"}


def test_forward_shapes_and_causality():
    model, data = build(TINY, seed=0)
    model.eval()
    x, y = data[0]
    logits, loss = model(x[None], y[None])
    assert logits.shape == (1, TINY.ctx_len, TINY.vocab_size) and loss.ndim == 0
    x2 = x.clone()
    x2[-1] = (x2[-1] + 1) % TINY.vocab_size  # changing the last token leaves earlier logits alone
    with torch.no_grad():
        a, b = model(x[None]), model(x2[None])
    torch.testing.assert_close(a[0, :-1], b[0, :-1], rtol=0, atol=0)


def test_dataset_is_deterministic_per_seed():
    _, a = build(TINY, seed=3)
    _, b = build(TINY, seed=3)
    _, c = build(TINY, seed=4)
    assert len(a) == TINY.data_windows
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, c.tokens)
    x, y = a[5]
    assert x.shape == y.shape == (TINY.ctx_len,)
    assert torch.equal(x[1:], y[:-1])  # targets are the inputs shifted by one
    assert int(a.tokens.max()) < TINY.vocab_size


def _train_one_step(model, data):
    torch.manual_seed(7)  # dropout draws from the global RNG
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = data[0]
    _, loss = model(x[None], y[None])
    loss.backward()
    opt.step()
    return opt


def test_state_digest_stable_across_builds_and_changed_by_training():
    m1, d1 = build(TINY, seed=0)
    m2, _ = build(TINY, seed=0)
    assert state_digest(m1) == state_digest(m2)
    assert state_digest(m1) != state_digest(build(TINY, seed=1)[0])
    before = state_digest(m1)
    opt1 = _train_one_step(m1, d1)
    after = state_digest(m1, opt1)
    assert after != before and state_digest(m1) != before
    opt2 = _train_one_step(m2, build(TINY, seed=0)[1])
    assert state_digest(m2, opt2) == after  # same seed, same step: same bits, optimizer too
    assert state_digest({"gpt": m1}, {"adamw": opt1}) != after  # names are part of the digest


def test_digest_is_order_independent_and_covers_dtype_and_shape():
    t = torch.arange(6, dtype=torch.float32)
    base = digest([("a", t), ("b", t * 2)])
    assert digest([("b", t * 2), ("a", t)]) == base
    assert digest([("a", t.double()), ("b", t * 2)]) != base
    assert digest([("a", t.view(2, 3)), ("b", t * 2)]) != base
    with pytest.raises(ValueError):
        digest([("a", t), ("a", t)])
