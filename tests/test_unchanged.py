"""Only what changed is copied (#50): a tensor unchanged since its slot last took it (a
frozen base model) is neither copied nor hashed again, and is never restored stale: every
way of changing a frozen tensor (in place under no_grad, through ``p.data``, swapped for
another) is caught, and the restore of every step is the state at that step, bit for bit.
No Ray: the single-process Checkpointer over real shared-memory slots, and a real SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import memckpt
from memckpt.engine import shared_pages
from memckpt.errors import ConfigError
from memckpt.format import shard as fmt

MiB = 1 << 20


def _lora_like(seed: int = 0, width: int = 512) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen base (1 MiB at ``width`` 512) and a small trainable adapter: the base is ~90%
    of the state."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 16))
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    return model, opt


def _train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 512, generator=g)
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _snapshot_state(model, opt) -> dict[str, torch.Tensor]:
    out = {f"m/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, st in enumerate(opt.state.values()):
        out.update({f"o/{i}/{k}": v.clone() for k, v in st.items() if torch.is_tensor(v)})
    return out


def _restored(cfg: memckpt.Config, step: int, build=None) -> dict[str, torch.Tensor]:
    """A fresh process's view: a new Checkpointer restores ``step`` into a new model (of
    ``build``, ``_lora_like`` by default)."""
    model, opt = (build or _lora_like)(seed=99)  # other values: the restore must overwrite them all
    _train(model, opt, 0)  # the optimizer has state to load into
    ckpt = memckpt.Checkpointer(cfg)
    with ckpt.engine.reading(step, verify=True) as shard:
        state = memckpt.TrainState(model, opt)
        assert state.load(shard.tensors, shard.meta) == step
    ckpt.close()
    return _snapshot_state(model, opt)


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].reshape(-1).view(torch.uint8),
                           b[k].reshape(-1).view(torch.uint8)), k


def _config(tmp_path, name: str, mode: str = "verify") -> memckpt.Config:
    return memckpt.Config(job_name=name, ram_root=str(tmp_path),
                          engine=memckpt.EngineConfig(skip_unchanged=mode))


def _base_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model[0].parameters())


@pytest.mark.parametrize("mode", ["verify", "trust"])
def test_a_frozen_base_is_copied_once_per_slot_and_every_step_restores_exactly(tmp_path, mode):
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    cfg = _config(tmp_path, f"frozen-{mode}", mode)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    base = _base_bytes(model)
    copied, unchanged, expect = [], [], {}
    for step in range(1, 7):
        _train(model, opt, step)
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
        copied.append(ckpt.engine.stats.last_copied_bytes)
        unchanged.append(ckpt.engine.stats.last_unchanged_bytes)
        # both slots restore their own step exactly, the skipped bytes included
        for held in ckpt.engine.steps():
            with ckpt.engine.reading(held, verify=True) as shard:
                assert shard.step == held
    ckpt.close()
    # the first snapshot copies the base; every later one skips it (unchanged since the
    # newest snapshot, whose pages the slot being written shares); frozen tensors are laid
    # out first, and those in the chunk where the trained ones start are copied with them
    chunk = fmt.chunk_bytes_for(1)
    assert unchanged[0] == 0 and all(base - chunk <= u <= base for u in unchanged[1:]), unchanged
    assert all(c < copied[0] - base + MiB // 8 for c in copied[1:]), copied
    for step in (5, 6):
        _assert_same(_restored(cfg, step), expect[step])


@pytest.mark.parametrize("mode", ["verify", "trust"])
def test_a_frozen_tensor_changed_in_place_or_swapped_is_copied(tmp_path, mode):
    """In place under no_grad (the version counter moves) and a tensor swapped for another
    (another object, another address): caught in either mode."""
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    cfg = _config(tmp_path, f"changed-{mode}", mode)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect = {}
    changes = {3: lambda: model[0].weight.add_(1.0),  # in place, no_grad
               4: lambda: model[0].bias.mul_(2.0),
               5: lambda: setattr(model[0], "weight", torch.nn.Parameter(
                   model[0].weight.detach() * 0.5, requires_grad=False)),  # swapped
               6: lambda: torch.nn.init.normal_(model[0].weight)}
    for step in range(1, 8):
        _train(model, opt, step)
        if step in changes:
            with torch.no_grad():
                changes[step]()
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
        if step in changes:
            assert ckpt.engine.stats.last_copied_bytes >= model[0].bias.nbytes, step
    ckpt.close()
    for step in (6, 7):
        _assert_same(_restored(cfg, step), expect[step])


def test_a_frozen_tensor_written_through_p_data_is_caught_by_verify(tmp_path):
    """``p.data.copy_(...)`` bypasses autograd's version counter: the stamp looks the same,
    the bytes are not. "verify" compares the bytes and copies it."""
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    cfg = _config(tmp_path, "data-write")
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect = {}
    for step in range(1, 7):
        _train(model, opt, step)
        if step == 5:
            v = model[0].weight._version
            model[0].weight.data.copy_(torch.full_like(model[0].weight, 3.0))
            assert model[0].weight._version == v  # invisible to the version counter
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
    ckpt.close()
    restored = _restored(cfg, 5)
    assert torch.equal(restored["m/0.weight"], torch.full_like(model[0].weight, 3.0))
    _assert_same(restored, expect[5])
    _assert_same(_restored(cfg, 6), expect[6])


def test_trust_takes_only_frozen_parameters_on_their_stamp(tmp_path):
    """An old-style optimizer writes a trained parameter through ``p.data`` (no version
    counter moves): "trust" takes only frozen parameters on their stamp alone, so the trained
    one is still compared, found changed and copied; every step restores exactly."""
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    cfg = _config(tmp_path, "trust-trained", "trust")
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect = {}
    for step in range(1, 7):
        g = torch.Generator().manual_seed(step)
        model.zero_grad()
        model(torch.randn(4, 512, generator=g)).square().mean().backward()
        for p in model[1].parameters():
            p.data.add_(p.grad, alpha=-0.1)  # no version bump
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
    ckpt.close()
    _assert_same(_restored(cfg, 6), expect[6])
    _assert_same(_restored(cfg, 5), expect[5])


def test_unchanged_chunks_are_not_hashed_again_and_the_seal_still_verifies(tmp_path,
                                                                           monkeypatch):
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    ckpt = memckpt.Checkpointer(_config(tmp_path, "hash"))
    ckpt.restore(state)
    hashed: list[int] = []
    real = fmt.checksum
    monkeypatch.setattr(fmt, "checksum", lambda data: (hashed.append(len(memoryview(data))),
                                                       real(data))[1])
    per_step = []
    for step in range(1, 6):
        _train(model, opt, step)
        hashed.clear()
        assert ckpt.step(state, step)
        ckpt.wait()
        per_step.append(sum(hashed))
        with ckpt.engine.reading(step, verify=True):  # every chunk's digest checks out
            pass
    ckpt.close()
    base = _base_bytes(model)
    assert per_step[2] < per_step[0] - base + 2 * fmt.CHUNK_BYTES, per_step


def test_off_copies_everything_every_time(tmp_path):
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    ckpt = memckpt.Checkpointer(_config(tmp_path, "off", "off"))
    ckpt.restore(state)
    for step in range(1, 5):
        _train(model, opt, step)
        assert ckpt.step(state, step)
        ckpt.wait()
        assert ckpt.engine.stats.last_unchanged_bytes == 0
    ckpt.close()


def test_a_bad_skip_unchanged_is_a_config_error():
    with pytest.raises(ConfigError, match="engine.skip_unchanged"):
        memckpt.EngineConfig(skip_unchanged="sometimes")


CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import torch, memckpt
    from memckpt.engine import snapshot
    from test_unchanged import _lora_like, _train
    root, kill_at = sys.argv[1], int(sys.argv[2])
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    cfg = memckpt.Config(job_name="killed", ram_root=root)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    real = snapshot.SnapshotEngine._copied
    def copied(self, slot, name, t, span):
        real(self, slot, name, t, span)
        if self.stats.last_step == kill_at - 1 and self.stats.last_unchanged_bytes:
            os.kill(os.getpid(), signal.SIGKILL)  # half way through step kill_at: the base
            # skipped (unchanged), one changed tensor copied, the rest not
    snapshot.SnapshotEngine._copied = copied
    for step in range(1, 10):
        _train(model, opt, step)
        ckpt.step(state, step)
        ckpt.wait()
""")


def test_a_process_killed_half_way_through_a_step_that_skipped_its_base(tmp_path):
    """SIGKILL while step 6 is written into the slot step 4 held: its frozen base was left
    in place (unchanged), one changed tensor copied, the rest not. The slot is flagged
    torn and never restored; a new process restores step 5, the last complete one, equal
    bit for bit to the uninterrupted run's step 5."""
    root = tmp_path / "ram"
    script = CHILD.format(tests=os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-c", script, str(root), "6"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    model, opt = _lora_like()
    for step in range(1, 6):
        _train(model, opt, step)
    expect = _snapshot_state(model, opt)
    cfg = memckpt.Config(job_name="killed", ram_root=str(root))
    ckpt = memckpt.Checkpointer(cfg)
    assert ckpt.engine.steps() == [5]  # step 6's slot is torn: not listed
    # the slot step 6 was being written into shares step 5's pages (its base)
    assert shared_pages.read_away(shared_pages.partner(ckpt.engine.path_of(5)))
    ckpt.close()
    fresh, fresh_opt = _lora_like(seed=7)
    _train(fresh, fresh_opt, 0)
    again = memckpt.Checkpointer(cfg)
    assert again.restore(memckpt.TrainState(fresh, fresh_opt)) == 5
    again.close()
    _assert_same(_snapshot_state(fresh, fresh_opt), expect)


# -- the capture kept between steps: it must never hand the engine a stale alias ------------

def _walks(monkeypatch) -> list[int]:
    """Counts the state_dict walks of a root model (a capture that reuses its last walk
    makes none)."""
    calls: list[int] = []
    real = torch.nn.Module.state_dict

    def counted(self, *args, **kwargs):
        if not kwargs.get("prefix"):
            calls.append(1)
        return real(self, *args, **kwargs)
    monkeypatch.setattr(torch.nn.Module, "state_dict", counted)
    return calls


def _assert_capture_is_fresh(state: memckpt.TrainState, model, opt) -> None:
    """``state``'s capture (maybe reusing its last walk) is what a new TrainState captures:
    the same names, each aliasing the same bytes the same way, the same frozen and stable
    sets and the same metadata."""
    got, ref = state.capture(1), memckpt.TrainState(model, opt).capture(1)
    assert [n for n, _ in got.tensors] == [n for n, _ in ref.tensors]
    for (name, a), (_, b) in zip(got.tensors, ref.tensors):
        if not name.startswith(("model/", "optim/")):  # the RNG state: a new tensor each time
            assert torch.equal(a, b), name
            continue
        assert (a.dtype, a.shape, a.stride(), a.data_ptr(), a.requires_grad) == \
            (b.dtype, b.shape, b.stride(), b.data_ptr(), b.requires_grad), name
        assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr(), name
    assert got.frozen == ref.frozen and got.stable == ref.stable
    assert got.meta == ref.meta


def _square(model) -> torch.nn.Module:
    return model[0]


MUTATIONS = {
    "a frozen parameter added": lambda m: _square(m).register_parameter(
        "extra", torch.nn.Parameter(torch.ones(3), requires_grad=False)),
    "a buffer added": lambda m: _square(m).register_buffer("count", torch.zeros(2)),
    "a buffer made non-persistent": lambda m: _square(m).register_buffer(
        "count", _square(m).count, persistent=False),
    "a parameter removed": lambda m: delattr(_square(m), "extra"),
    "a parameter swapped by setattr": lambda m: setattr(_square(m), "weight", torch.nn.Parameter(
        _square(m).weight.detach() + 1, requires_grad=False)),
    "a parameter swapped in its dict (no hook)": lambda m: _square(m)._parameters.__setitem__(
        "weight", torch.nn.Parameter(_square(m).weight.detach() * 2, requires_grad=False)),
    "p.data swapped": lambda m: setattr(_square(m).weight, "data",
                                        torch.randn_like(_square(m).weight)),
    "p.data transposed (same address and shape)": lambda m: setattr(
        _square(m).weight, "data", _square(m).weight.data.t()),
    "p.data viewed as another dtype": lambda m: setattr(
        _square(m).bias, "data", _square(m).bias.data.view(torch.int32)),
    "a frozen bias resized in place": lambda m: _square(m).bias.resize_(256),
    "requires_grad flipped on": lambda m: _square(m).weight.requires_grad_(True),
    "requires_grad flipped off": lambda m: m[1].bias.requires_grad_(False),
    "a submodule appended": lambda m: m.append(torch.nn.Linear(512, 512)),
    "a weight tied": lambda m: setattr(m[2], "weight", _square(m).weight),
    "a submodule swapped in its dict": lambda m: m._modules.__setitem__(
        "2", torch.nn.Linear(512, 512)),
    "a state_dict post-hook": lambda m: _square(m).register_state_dict_post_hook(
        lambda *a: None),
}


def test_a_kept_capture_follows_every_change_of_the_model(monkeypatch):
    """The models' part of a capture is kept from one capture to the next (no state_dict walk)
    while the models are what they were, and walked again after any change that makes their
    state_dict or its tensors other: each change below, one after the other, leaves a capture
    equal to a new TrainState's."""
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    walks = _walks(monkeypatch)
    state.capture(0)
    for step in range(1, 3):
        _train(model, opt, step)
        _assert_capture_is_fresh(state, model, opt)
    walks.clear()
    state.capture(3)
    assert walks == [], "a model unchanged but for training is walked again"
    for what, change in MUTATIONS.items():
        with torch.no_grad():
            change(model)
        try:
            _assert_capture_is_fresh(state, model, opt)
        except AssertionError as e:
            raise AssertionError(f"after {what}: {e}") from None


@pytest.mark.parametrize("mode", ["verify", "trust"])
@pytest.mark.parametrize("change", ["p.data swapped", "a parameter swapped in its dict (no hook)",
                                    "p.data transposed (same address and shape)"])
def test_a_frozen_tensor_replaced_behind_the_capture_is_copied(tmp_path, mode, change):
    """Through a Checkpointer: a frozen weight replaced in ways no version counter sees is
    copied, and both slots restore their own step bit for bit."""
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    cfg = _config(tmp_path, f"replaced-{mode}", mode)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect = {}
    for step in range(1, 7):
        _train(model, opt, step)
        if step == 5:
            with torch.no_grad():
                MUTATIONS[change](model)
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
        if step == 5:
            assert ckpt.engine.stats.last_copied_bytes >= model[0].weight.nbytes
    ckpt.close()
    for step in (5, 6):
        _assert_same(_restored(cfg, step), expect[step])


def test_trust_compares_a_tensor_whose_requires_grad_was_flipped_on(tmp_path):
    """A frozen weight made trainable, then written through ``p.data`` (no version bump):
    it is no longer frozen, so "trust" compares its bytes and copies it."""
    model, opt = _lora_like()
    state = memckpt.TrainState(model, opt)
    cfg = _config(tmp_path, "flipped", "trust")
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect = {}
    for step in range(1, 7):
        _train(model, opt, step)
        if step == 4:
            model[0].weight.requires_grad_(True)
        if step == 5:
            model[0].weight.data.copy_(torch.full_like(model[0].weight, 2.0))
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
    ckpt.close()
    restored = _restored(cfg, 5)
    assert torch.equal(restored["m/0.weight"], torch.full_like(model[0].weight, 2.0))
    _assert_same(restored, expect[5])
    _assert_same(_restored(cfg, 6), expect[6])
