"""The two slots share the pages of unchanged chunks (#50): a job whose state is mostly
frozen holds about one copy of it, not two, and every step still restores bit for bit, in
this process and in a fresh one, across a layout change. No Ray: the single-process
Checkpointer over real tmpfs files, their allocated blocks counted."""

from __future__ import annotations

import pytest
import torch

import memckpt
from memckpt.engine import shared_pages
from memckpt.engine.buffers import PeakFootprint, allocated_bytes
from memckpt.format import shard as fmt

from test_unchanged import _assert_same, _lora_like, _snapshot_state

MiB = 1 << 20


# -- the plan (pure) ---------------------------------------------------------------------------
def test_without_a_complete_partner_every_chunk_is_written_home_and_nothing_is_punched():
    assert shared_pages.plan(3, None, share=[0, 1, 2]) == shared_pages.Plan((False,) * 3, (), ())


def test_a_shared_chunk_takes_the_partners_home_and_frees_the_other():
    # chunk 0: the partner is in its own file; chunk 1: the partner lives in ours
    got = shared_pages.plan(2, [False, True], share=[0, 1])
    assert got.away == (True, False)  # 0: its file; 1: our file, where it lives
    assert got.punch_own == (0,) and got.punch_partner == (1,)


def test_a_written_chunk_goes_where_the_partner_is_not():
    got = shared_pages.plan(2, [False, True], share=[])
    assert got.away == (False, True)  # never the page the complete partner uses
    assert got.punch_own == () and got.punch_partner == ()


def test_runs_and_byte_ranges():
    assert shared_pages.runs([5, 1, 2, 3, 7]) == [(1, 4), (5, 6), (7, 8)]
    geo = shared_pages.Geometry(data_offset=4096, chunk_bytes=8192, data_len=20000)
    assert geo.chunks == 3
    assert geo.byte_ranges([0, 1, 2]) == [(4096, 20000)]
    assert geo.indices(geo.byte_ranges([1, 2])) == {1, 2}


# -- a mostly frozen job -----------------------------------------------------------------------
def _frozen_base(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A frozen 4 MiB base before a small trainable head: the base ~97% of the state."""
    return _lora_like(seed, width=1024)


def _train(model, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    opt.zero_grad()
    model(torch.randn(4, 1024, generator=g)).square().mean().backward()
    opt.step()


def _restored(cfg: memckpt.Config, step: int) -> dict[str, torch.Tensor]:
    """A fresh Checkpointer's view of ``step``, loaded into a new model."""
    model, opt = _frozen_base(seed=99)
    _train(model, opt, 0)
    ckpt = memckpt.Checkpointer(cfg)
    with ckpt.engine.reading(step, verify=True) as shard:
        assert memckpt.TrainState(model, opt).load(shard.tensors, shard.meta) == step
    ckpt.close()
    return _snapshot_state(model, opt)


def _run(cfg: memckpt.Config, steps: range, model, opt) -> dict[int, dict[str, torch.Tensor]]:
    state = memckpt.TrainState(model, opt)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect = {}
    for step in steps:
        _train(model, opt, step)
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
        for held in ckpt.engine.steps():  # both slots restore their step, shared bytes too
            with ckpt.engine.reading(held, verify=True) as shard:
                assert shard.step == held
    ckpt.close()
    return expect


@pytest.mark.parametrize("mode", ["verify", "trust"])
def test_a_frozen_base_is_held_once_and_every_step_restores_exactly(tmp_path, mode):
    cfg = memckpt.Config(job_name=f"shared-{mode}", ram_root=str(tmp_path),
                         engine=memckpt.EngineConfig(skip_unchanged=mode))
    model, opt = _frozen_base()
    with PeakFootprint(tmp_path / cfg.job_name, every_s=0.005) as held:
        expect = _run(cfg, range(1, 7), model, opt)
    # one copy of the base (and of the chunk the head starts in), two of the head
    assert held.state_bytes > 4 * MiB and held.ratio < 1.2, (held.ratio, held.at_peak)
    for step in (5, 6):
        _assert_same(_restored(cfg, step), expect[step])  # a fresh Checkpointer: from the files


def test_a_steady_step_reuses_its_slots_layout_and_a_changed_base_does_not(tmp_path):
    """Steps whose slots are asked the same share the same way without working it out
    again (the decision kept on the slot); a frozen weight changed in place then is copied
    into pages of its own, and every step restores exactly, the committed one included."""
    cfg = memckpt.Config(job_name="steady", ram_root=str(tmp_path))
    model, opt = _frozen_base()
    state = memckpt.TrainState(model, opt)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    expect, laid = {}, {}
    frozen = next(p for p in model.parameters() if not p.requires_grad)
    for step in range(1, 9):
        _train(model, opt, step)
        if step == 7:
            with torch.no_grad():
                frozen.mul_(1.5)  # in place, under no_grad: its version counter moves
        assert ckpt.step(state, step)
        ckpt.wait()
        expect[step] = _snapshot_state(model, opt)
        slot = next(s for s in ckpt.engine.slots if s.step == step)
        laid[step] = slot.laid
        assert ckpt.engine.stats.last_copied_bytes < 1 * MiB or step in (1, 2, 7, 8)
    assert laid[5] is laid[3] and laid[6] is laid[4]  # steady: decided once per slot
    assert laid[7] is not laid[5] and laid[8] is not laid[6]  # the base moved: decided again
    ckpt.close()
    for step in (7, 8):
        _assert_same(_restored(cfg, step), expect[step])


def test_with_sharing_off_both_slots_hold_the_base(tmp_path):
    cfg = memckpt.Config(job_name="unshared", ram_root=str(tmp_path),
                         engine=memckpt.EngineConfig(share_unchanged=False))
    model, opt = _frozen_base()
    with PeakFootprint(tmp_path / cfg.job_name, every_s=0.005) as held:
        _run(cfg, range(1, 4), model, opt)
    assert held.ratio > 1.9, held.ratio


def test_a_restarted_process_keeps_sharing_without_copying_the_base_again(tmp_path):
    """A new process adopts the slots (their sidecars), restores the newest, and its first
    snapshot compares instead of copying: the base stays one copy, and the steps after the
    restart restore exactly as an uninterrupted run's."""
    cfg = memckpt.Config(job_name="restart", ram_root=str(tmp_path))
    model, opt = _frozen_base()
    _run(cfg, range(1, 4), model, opt)
    uninterrupted = _snapshot_state(model, opt)
    folder = tmp_path / cfg.job_name
    before = allocated_bytes(folder)
    fresh, fresh_opt = _frozen_base(seed=5)
    _train(fresh, fresh_opt, 0)
    state = memckpt.TrainState(fresh, fresh_opt)
    ckpt = memckpt.Checkpointer(cfg)
    assert ckpt.restore(state) == 3
    _assert_same(_snapshot_state(fresh, fresh_opt), uninterrupted)
    _train(fresh, fresh_opt, 4)
    _train(model, opt, 4)
    assert ckpt.step(state, 4)
    ckpt.wait()
    base = sum(p.numel() * p.element_size() for p in fresh[0].parameters())
    assert ckpt.engine.stats.last_copied_bytes < base // 4
    assert allocated_bytes(folder) < before + MiB
    ckpt.close()
    _assert_same(_restored(cfg, 4), _snapshot_state(model, opt))


def test_a_layout_change_keeps_the_committed_step_whole(tmp_path):
    """The slot being written is re-laid out (a new optimizer state appears) while the
    committed step keeps pages in its file: they are copied home first, and the committed
    step still restores exactly."""
    cfg = memckpt.Config(job_name="relaid", ram_root=str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16))
    model[0].requires_grad_(False)
    opt = torch.optim.AdamW(model[1].parameters(), lr=1e-2)
    state = memckpt.TrainState(model, opt)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    ckpt.step(state, 1)  # no optimizer state yet
    ckpt.wait()
    ckpt.step(state, 2)  # unchanged: shares all of step 1's pages
    ckpt.wait()
    assert shared_pages.read_away(ckpt.engine.path_of(2))
    expect2 = _snapshot_state(model, opt)
    _train(model, opt, 3)  # Adam's moments appear: step 3 needs another layout
    ckpt.step(state, 3)  # rewrites step 1's file, where step 2's pages live
    ckpt.wait()
    assert ckpt.engine.steps() == [3, 2]
    with ckpt.engine.reading(2, verify=True) as shard:
        got = {k: v for k, v in shard.tensors.items()}
        assert torch.equal(got["model/model/0.weight"], expect2["m/0.weight"])
    ckpt.close()


def test_a_slot_whose_partner_file_was_replaced_is_refused_not_misread(tmp_path):
    cfg = memckpt.Config(job_name="replaced", ram_root=str(tmp_path))
    model, opt = _frozen_base()
    _run(cfg, range(1, 3), model, opt)
    rank_dir = next((tmp_path / cfg.job_name).rglob("slot0.shard")).parent
    sharing = [p for p in (rank_dir / n for n in fmt.SLOT_NAMES) if shared_pages.read_away(p)]
    assert sharing
    other = shared_pages.partner(sharing[0])
    other.rename(other.with_name("kept"))  # kept: its inode number is not reused
    other.write_bytes(other.with_name("kept").read_bytes())  # a copy in another file
    with pytest.raises(memckpt.errors.MemckptError, match="replaced"):
        shared_pages.open_slot(sharing[0])
