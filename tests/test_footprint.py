"""Host RAM memckpt holds (#50): the planned footprint, the budget, and the stop before the
first snapshot when a job would not fit. No Ray: the pure plan and the single-process
Checkpointer against real shared-memory files."""

from __future__ import annotations

import os

import pytest
import torch

import memckpt
from memckpt.engine.buffers import PeakFootprint, allocated_bytes
from memckpt.engine.snapshot import SnapshotEngine
from memckpt.format.state import Captured
from memckpt.errors import ConfigError, MemoryBudgetError
from memckpt.policy.footprint import (NodeFootprint, budget_bytes, check_ram_budget,
                                      human_bytes, over_budget, spare_room)

MiB = 1 << 20


def test_a_node_holds_two_slots_per_rank_it_runs_and_per_copy_it_keeps():
    fp = NodeFootprint.even(100 * MiB, own_ranks=8, replica_ranks=8)
    assert fp.own_bytes == fp.replica_bytes == 1600 * MiB
    assert fp.total == 3200 * MiB and fp.state_bytes == 800 * MiB
    assert fp.total / fp.state_bytes == 4.0  # 2 + 2k with one replica
    two = NodeFootprint.even(100 * MiB, own_ranks=8, replica_ranks=16)
    assert two.total / two.state_bytes == 6.0  # 2 + 2k with k = 2
    assert "2 slots x 8 rank(s) run here x 100.0 MiB = 1.56 GiB" in fp.explain()
    assert "8 peer rank(s) whose copies this node keeps" in fp.explain()
    alone = NodeFootprint.even(MiB, own_ranks=1, replica_ranks=0)
    assert "peer" not in alone.explain()  # no replicas, no clause about them
    with pytest.raises(ValueError, match="negative"):
        NodeFootprint.even(-1, own_ranks=1, replica_ranks=0)


def test_the_budget_is_a_fraction_of_the_nodes_ram_or_bytes():
    assert budget_bytes(0.5, 64 << 30) == 32 << 30
    assert budget_bytes(1.0, 64 << 30) == 64 << 30
    assert budget_bytes(8 << 30, 64 << 30) == 8 << 30
    assert check_ram_budget(0.25) == check_ram_budget(4 << 30) == ""
    for bad in (0.0, 1.5, -0.1, 1, 100, True, "64GiB", None):
        assert check_ram_budget(bad), bad
    assert spare_room(10 * MiB, 4 * MiB) == 6 * MiB and spare_room(MiB, 4 * MiB) == 0


@pytest.mark.parametrize("value,fix", [(1.5, "in (0, 1]"), (1, "at least 1048576"),
                                       ("64GiB", "a number of bytes"), (True, "a fraction")])
def test_a_bad_ram_budget_is_a_config_error_that_says_what_to_pass(value, fix):
    with pytest.raises(ConfigError, match="ram_budget=") as ei:
        memckpt.Config(ram_budget=value)
    assert fix in str(ei.value)


def test_the_budget_does_not_change_what_a_snapshot_holds():
    """A job restarted with another budget resumes its snapshots (not in the fingerprint)."""
    assert (memckpt.Config(ram_budget=0.9).fingerprint()
            == memckpt.Config(ram_budget=64 << 20).fingerprint())


def test_over_budget_names_the_numbers_and_the_settings_that_lower_them():
    fp = NodeFootprint.even(10 * MiB, own_ranks=2, replica_ranks=2)  # 80 MiB
    assert over_budget(fp, budget=80 * MiB, shm_free=1 << 30) == ""
    msg = over_budget(fp, budget=64 * MiB, shm_free=1 << 30)
    assert "would hold 80.0 MiB" in msg and "more than ram_budget allows" in msg
    assert "This node's state is 20.0 MiB" in msg and "ram_budget allows 64.0 MiB" in msg
    for setting in ("placement.replicas", "workers.workers_per_node", "Config.ram_budget",
                    "/dev/shm"):
        assert setting in msg
    tmpfs = over_budget(fp, budget=1 << 30, shm_free=50 * MiB)
    assert "the free room of the shared-memory file system" in tmpfs and "50.0 MiB free" in tmpfs
    assert human_bytes(512) == "512 B" and human_bytes(3 * MiB) == "3.00 MiB"


def _state(width: int = 256) -> memckpt.TrainState:
    torch.manual_seed(0)
    model = torch.nn.Linear(width, width)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    opt.step()  # Adam's moments exist: params + 2 moments, 12 bytes a parameter
    return memckpt.TrainState(model, opt)


def test_a_checkpointer_over_budget_stops_before_its_first_snapshot_allocates(tmp_path):
    """The 1024x1024 AdamW state is ~12 MiB a slot: a 16 MiB budget cannot hold two."""
    state = _state(1024)
    cfg = memckpt.Config(job_name="over", ram_root=str(tmp_path), ram_budget=16 * MiB)
    ckpt = memckpt.Checkpointer(cfg)
    assert ckpt.restore(state) == 0
    with pytest.raises(MemoryBudgetError) as ei:
        ckpt.step(state, 1)
    msg = str(ei.value)
    assert "2 slots x 1 rank(s) run here" in msg and "ram_budget allows 16.0 MiB" in msg
    assert "rank 0" in msg and "job 'over'" in msg
    assert allocated_bytes(tmp_path) == 0 and not list(tmp_path.rglob("*.shard"))
    ckpt.close()


def test_ranks_sharing_a_node_are_planned_together(tmp_path, monkeypatch):
    """Under torchrun every rank of a node checks the node's whole footprint
    (LOCAL_WORLD_SIZE ranks' slots), not its own alone."""
    state = _state(512)  # ~3 MiB a slot
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 ranks x 2 slots x 3 MiB = 48 MiB
    cfg = memckpt.Config(job_name="shared", ram_root=str(tmp_path), ram_budget=32 * MiB)
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    with pytest.raises(MemoryBudgetError, match="2 slots x 8 rank"):
        ckpt.step(state, 1)
    ckpt.close()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ckpt = memckpt.Checkpointer(cfg)
    ckpt.restore(state)
    assert ckpt.step(state, 1) and ckpt.step(state, 2)
    ckpt.close(unlink=True)


def test_a_checkpointer_within_budget_holds_two_slots_at_its_peak(tmp_path):
    """One process, no replicas, every tensor changing each step: its footprint is its two
    slots, 2x the state (plus the headers), sampled over real snapshots and a restore."""
    state = _state(512)
    cfg = memckpt.Config(job_name="within", ram_root=str(tmp_path), ram_budget=64 * MiB)
    with PeakFootprint(tmp_path / "within", every_s=0.005) as held:
        ckpt = memckpt.Checkpointer(cfg)
        ckpt.restore(state)
        for step in range(1, 6):
            for opt in state.optimizers.values():
                opt.step()  # the gradients stay: every parameter and moment moves
            assert ckpt.step(state, step)
        ckpt.close()
        again = memckpt.Checkpointer(cfg)
        assert again.restore(_state(512)) == 5
        again.close(unlink=True)
    assert held.state_bytes > 3 * MiB
    assert 1.9 <= held.ratio <= 2.05, (held.ratio, held.at_peak)


def test_peak_footprint_leaves_out_a_removed_nodes_files(tmp_path):
    """A node a drill removed took its RAM with it; on one machine its tmpfs files stay."""
    for node, rank in (("n1", 0), ("n2", 1)):
        engine = SnapshotEngine(tmp_path / node / "own" / f"rank{rank}", share_unchanged=False)
        for step in (1, 2):  # two slots, each 1 MiB of tensor bytes
            data = torch.frombuffer(bytearray(os.urandom(MiB)), dtype=torch.uint8)
            assert engine.snapshot(Captured([("t", data)], frozenset(), {}), step)
            engine.wait()
        engine.close()
    with PeakFootprint(tmp_path, gone={"n2"}) as held:
        pass
    # the state: the tensor bytes and the header; held: the two slots (headers on pages)
    assert MiB < held.state_bytes < MiB + 4096 and 2 * MiB < held.peak < 2 * MiB + 64 * 1024
    assert list(held.at_peak) == ["n1/own/rank0"]


def test_a_resized_slot_lets_its_old_pages_go_before_taking_new_ones(tmp_path, monkeypatch):
    """A slot whose layout grew (Adam's moments appear after the first step) is made anew;
    the old file is gone before the new one is allocated, so the two are never held
    together (a third slot's worth at the peak, seen in the demo before)."""
    from memckpt.engine.buffers import RamRegion
    path = tmp_path / "slot0.shard"
    RamRegion.create(path, 4 * MiB).close()
    seen = []
    create = RamRegion.create

    def spy(p, size, pin=False, populate=True):
        seen.append((p.exists(), allocated_bytes(tmp_path)))
        return create(p, size, pin=pin, populate=populate)

    monkeypatch.setattr(RamRegion, "create", staticmethod(spy))
    region = RamRegion.reuse_or_create(path, 8 * MiB)
    assert seen == [(False, 0)] and path.stat().st_size == 8 * MiB
    region.close()
    again = RamRegion.reuse_or_create(path, 8 * MiB)  # the same size: reused, not made
    assert len(seen) == 1
    again.close()


def test_uneven_ranks_are_planned_at_their_own_sizes():
    """A node runs a small rank and keeps the copy of a large one (rank 0 with extra
    state, a pipeline stage): the small rank's own size times four slots was the old
    estimate, 1 MiB; the node really holds 2 x 0.25 + 2 x 3 MiB."""
    sizes = {0: MiB // 4, 1: 3 * MiB, 2: MiB}
    node_a = NodeFootprint.of(sizes, own=[0], copies=[1])
    assert node_a.total == 2 * (MiB // 4) + 2 * 3 * MiB and node_a.state_bytes == MiB // 4
    assert NodeFootprint.even(MiB // 4, 1, 1).total == MiB  # what rank 0 alone would plan
    budget = 6 * MiB  # fits the estimate, not the node
    assert over_budget(NodeFootprint.even(MiB // 4, 1, 1), budget, 1 << 30) == ""
    msg = over_budget(node_a, budget, 1 << 30)
    assert "would hold 6.50 MiB" in msg and "x 256.0 KiB = 512.0 KiB" in msg
    assert "1 peer rank(s) whose copies this node keeps x 3.00 MiB = 6.00 MiB" in msg
    both = NodeFootprint.of(sizes, own=[0, 2], copies=[1])
    assert both.own_ranks == 2 and both.own_bytes == 2 * (MiB // 4 + MiB)
    assert "2 slots x 2 rank(s) run here (256.0 KiB to 1.00 MiB a slot, 1.25 MiB in all) " \
           "= 2.50 MiB" in both.explain()
    with pytest.raises(KeyError):  # a rank without a size is a caller's bug, not a guess
        NodeFootprint.of(sizes, own=[0], copies=[7])


def test_the_layout_before_counts_until_the_new_one_commits():
    """A resize keeps the old layout's files as the fallback: they are held, not room."""
    new = NodeFootprint.even(10 * MiB, own_ranks=1, replica_ranks=1)  # 40 MiB
    window = NodeFootprint.even(10 * MiB, own_ranks=1, replica_ranks=1, kept=20 * MiB)
    assert window.total == 60 * MiB and window.state_bytes == 10 * MiB
    assert over_budget(new, budget=50 * MiB, shm_free=1 << 30) == ""
    msg = over_budget(window, budget=50 * MiB, shm_free=1 << 30)
    assert "would hold 60.0 MiB" in msg and "plus 20.0 MiB of the layout before" in msg
    assert "until the new layout commits a step" in msg and "workers.min_workers" in msg
    assert "layout before" not in over_budget(new, budget=30 * MiB, shm_free=1 << 30)
    with pytest.raises(ValueError, match="kept"):
        NodeFootprint.even(MiB, 1, 0, kept=-1)


def _old_layout_file(node, sub: str, rank: int, nbytes: int) -> None:
    d = node / sub / f"rank{rank}"
    d.mkdir(parents=True, exist_ok=True)
    with open(d / "slot0.shard", "wb") as f:
        f.write(os.urandom(nbytes))


def test_a_rank_counts_the_old_layouts_files_its_node_still_holds(tmp_path):
    """After a resize renumbered the ranks, this node's own slots of old rank 2 and its copy
    of old rank 3 stay until the new layout commits; the new layout's own folder (rank 0:
    its files are resized in place) and its copies' folder (rank 1) are reused, not kept.
    A budget that fits the new layout alone but not the window stops the first slot."""
    from memckpt.runtime.worker.rank_checkpointer import RankCheckpointer
    node = tmp_path / "job" / "nodeA"
    for sub, rank in (("own", 2), ("replicas", 3), ("own", 0), ("replicas", 1)):
        _old_layout_file(node, sub, rank, 4 * MiB)
    state = _state(512)  # ~3 MiB a slot: 4 slots ~12.1 MiB; with the 8 MiB kept ~20 MiB
    cfg = memckpt.Config(job_name="job", ram_root=str(tmp_path), ram_budget=16 * MiB)
    ckpt = RankCheckpointer(cfg, 0, 2, node / "own", lambda s, p: None,
                            node_ranks=(0,), node_copies=(1,))
    assert ckpt.kept_bytes() == 8 * MiB
    ckpt.plan(state, 0)  # no process group: the estimate (the other rank is this size)
    with pytest.raises(MemoryBudgetError) as ei:
        ckpt.step(state, 0)
    msg = str(ei.value)
    assert "plus 8.00 MiB of the layout before" in msg and "ram_budget allows 16.0 MiB" in msg
    assert not (node / "own" / "rank0" / "slot1.shard").exists()
    ckpt.close()
    # once the driver freed the old layout (free_unserved), the same plan fits
    import shutil
    shutil.rmtree(node / "own" / "rank2")
    shutil.rmtree(node / "replicas" / "rank3")
    ckpt = RankCheckpointer(cfg, 0, 2, node / "own", lambda s, p: None,
                            node_ranks=(0,), node_copies=(1,))
    assert ckpt.kept_bytes() == 0
    ckpt.plan(state, 0)
    assert ckpt.step(state, 0)
    ckpt.close()
