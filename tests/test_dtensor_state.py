"""DTensor capture (FSDP2, tensor parallel, FSDP x TP) without Ray: real process groups.

Each scenario spawns ranks over gloo on a CPU device mesh, trains a small MLP two steps,
snapshots it through a :class:`memckpt.Checkpointer`, trains two more, restores the
snapshot and checks:

* the snapshot holds each rank's local tensor, and its ``meta["dtensors"]`` record
  places that chunk where torch's own gather (``full_tensor()``) has it, uneven and
  empty chunks included; plain tensors carry no record; ``world_size``/``rank`` are set;
* the restore is a local copy: the state digest equals the one taken at the snapshot,
  and training from there repeats the losses it had the first time, bit for bit;
* a snapshot of another layout is refused with the tensor's name, nothing loaded.

Ranks report through JSON files; the worker lives in this module so spawned children
import it by name.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

import _procs

HIDDEN = {"fsdp": 7, "tp": 8, "fsdp_tp": 8}  # 7 over 3 ranks: chunks of 3, 3, 1 (uneven)
OUT = 2  # the last layer's 2 rows over 3 ranks: the third rank's chunk is empty


def _model(mode: str, world: int, device: str) -> tuple[torch.nn.Module, int]:
    """(model, data-parallel rank) for ``mode`` on ``world`` ranks, on a ``device`` mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    hidden = HIDDEN[mode]
    m = torch.nn.Sequential(torch.nn.Linear(5, hidden), torch.nn.ReLU(),
                            torch.nn.Linear(hidden, 4), torch.nn.ReLU(),
                            torch.nn.Linear(4, OUT))
    m.register_buffer("seen", torch.zeros(()))  # a plain buffer beside the DTensors
    m.to(device)
    if mode == "fsdp":
        mesh = init_device_mesh(device, (world,))
        for layer in (m[0], m[2], m[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        return m, dist.get_rank()
    tp = 2
    mesh = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if mode == "fsdp_tp":
        for layer in (m[0], m[2], m[4]):
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
    return m, mesh["dp"].get_local_rank()


def _train(m, opt, dp_rank: int, steps: range, device: str) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        x, y = (torch.randn(6, n, generator=g).to(device) for n in (5, OUT))
        loss = torch.nn.functional.mse_loss(m(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        m.seen += 1
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item())
    return losses


def _worker(rank: int, world: int, port: int, mode: str, device: str, ram_root: str,
            out: str) -> None:
    import torch.distributed as dist

    import memckpt
    from memckpt.format import dtensor as dt
    from memckpt.format.digest import state_digest
    from memckpt.errors import StateError

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    m, dp_rank = _model(mode, world, device)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    state = memckpt.TrainState(model=m, optimizer=opt)
    ckpt = memckpt.Checkpointer(memckpt.Config(job_name=f"dt-{mode}", ram_root=ram_root),
                                rank, world)
    _train(m, opt, dp_rank, range(1, 3), device)
    captured = state.capture(2)
    chunks = {}  # name -> (record, local chunk == full[offsets] per torch's gather)
    live = dict(m.state_dict())
    live.update({f"{n}/{k}": v for n, p in m.named_parameters() for k, v in opt.state[p].items()})
    for name, t in captured.tensors:
        record = captured.meta["dtensors"].get(name)
        if not name.startswith(("model/", "optim/")):
            assert record is None, name
            continue
        key = name.split("/", 2)[2]
        src = live.get(key) if name.startswith("model/") else live.get(name.split("/", 3)[3])
        if record is None:
            chunks[name] = (None, type(src).__name__)
            continue
        full = src.full_tensor()
        index = tuple(slice(o, o + n) for o, n in zip(record["offsets"], t.shape))
        chunks[name] = (record, bool(torch.equal(full[index], t)) and list(full.shape)
                        == record["global_shape"] and type(t) is torch.Tensor
                        and t.device == full.device)
    ckpt.step(state, 2)
    ckpt.wait()
    # device-to-host into page-locked slots when CUDA is present
    pinned = all(s.region.tensor.is_pinned() for s in ckpt.engine.slots if s.region is not None)
    at_snapshot = state_digest(state)
    first = _train(m, opt, dp_rank, range(3, 5), device)
    restored = ckpt.restore(state)
    after_restore = state_digest(state)
    again = _train(m, opt, dp_rank, range(3, 5), device)
    # the same snapshot into a plain (unsharded) model: refused, naming a tensor
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(5, HIDDEN[mode]), torch.nn.ReLU(),
                                torch.nn.Linear(HIDDEN[mode], 4), torch.nn.ReLU(),
                                torch.nn.Linear(4, OUT))
    plain.register_buffer("seen", torch.zeros(()))
    before = [p.detach().clone() for p in plain.parameters()]
    try:
        ckpt.restore(memckpt.TrainState(model=plain))
        refused = ""
    except StateError as e:
        refused = str(e)
    untouched = all(torch.equal(a, b) for a, b in zip(before, plain.parameters()))
    # optimizer state alone, both ways: sharded into plain, plain into sharded
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain.to(device)(torch.ones(2, 5, device=device)).sum().backward()
    plain_opt.step()
    refused_optim = []
    with ckpt.engine.reading() as shard:
        pairs = [(memckpt.TrainState(model=plain, optimizer=plain_opt), shard.tensors, shard.meta)]
        cap = memckpt.TrainState(model=plain, optimizer=plain_opt).capture(0)
        pairs.append((state, dict(cap.tensors), cap.meta))
        for target, tensors, meta in pairs:
            try:
                target.load(tensors, meta, content=["optimizer"])
                refused_optim.append("")
            except StateError as e:
                refused_optim.append(str(e))
    # restored DTensors live where the job's do (the mesh's device)
    on_device = all(dt.local(t).device.type == device for t in m.state_dict().values())
    result = {"world_size": captured.meta["world_size"], "rank": captured.meta["rank"],
              "chunks": chunks, "at_snapshot": at_snapshot, "after_restore": after_restore,
              "restored": restored, "first": first, "again": again, "refused": refused,
              "untouched": untouched, "pinned": pinned, "on_device": on_device,
              "refused_optim": refused_optim}
    Path(f"{out}.rank{rank}.json").write_text(json.dumps(result))
    ckpt.close()
    dist.barrier()
    dist.destroy_process_group()


def _run(mode: str, world: int, ram_root: str, tmp_path: Path, device: str = "cpu") -> list[dict]:
    out = tmp_path / mode
    _procs.spawn(_worker, world, mode, device, ram_root, str(out))
    return [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(world)]


def _check(mode: str, world: int, results: list[dict], device: str) -> None:
    for rank, r in enumerate(results):
        assert (r["world_size"], r["rank"]) == (world, rank)
        records = {n: rec for n, (rec, _) in r["chunks"].items() if rec is not None}
        assert records, "no DTensor recorded"
        for name, (rec, ok) in r["chunks"].items():
            if rec is None:  # plain: step counters, the buffer, TP's unsharded last layer
                assert ok == "Tensor", f"{name} is a {ok} but has no DTensor record"
                assert name.endswith(("/step", "/seen")) or (mode == "tp" and "/4." in name), name
            else:
                assert ok is True, f"rank {rank} {name}: local chunk is not full[offsets] ({rec})"
                tp_mesh = [[world // 2, 2], [world // 2]] if mode == "fsdp_tp" else [[2]]
                assert rec["mesh_shape"] in ([[world]] if mode == "fsdp" else tp_mesh)
        assert r["restored"] == 2
        assert r["after_restore"] == r["at_snapshot"], f"rank {rank}: restore is not exact"
        assert r["again"] == r["first"], f"rank {rank}: training after restore diverged"
        assert "does not fit this process's layout" in r["refused"], r["refused"]
        assert "model/model/" in r["refused"]
        assert r["untouched"] and r["on_device"]
        saved_sharded, saved_plain = r["refused_optim"]
        assert "saved as a DTensor" in saved_sharded and "'optim/optimizer/model/" in saved_sharded
        assert "saved as a plain tensor" in saved_plain and "'optim/optimizer/model/" in saved_plain
        assert r["pinned"] == (device == "cuda")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode,world", [("fsdp", 3), ("tp", 2), ("fsdp_tp", 4)])
def test_dtensor_snapshot_is_local_and_restores_exactly(mode, world, ram_root, tmp_path):
    results = _run(mode, world, ram_root, tmp_path)
    _check(mode, world, results, "cpu")
    if mode == "fsdp":  # uneven Shard(0): 7 rows -> 3, 3, 1; 2 rows -> 1, 1, 0 (empty)
        w0 = [r["chunks"]["model/model/0.weight"][0]["offsets"] for r in results]
        assert w0 == [[0, 0], [3, 0], [6, 0]]
        last = [r["chunks"]["model/model/4.bias"][0] for r in results]
        assert [rec["offsets"] for rec in last] == [[0], [1], [2]]
        assert all(rec["placements"] == ["S(0)"] for rec in last)
    if mode == "tp":
        rec = results[1]["chunks"]["model/model/2.weight"][0]
        assert rec["placements"] == ["S(1)"]
        assert rec["offsets"] == [0, 4]


@pytest.mark.gpu
@pytest.mark.timeout(240)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode,need", [("fsdp", 1), ("tp", 2), ("fsdp_tp", 4)])
def test_dtensor_on_a_cuda_mesh_snapshots_into_pinned_memory(mode, need, ram_root, tmp_path):
    """The same over NCCL on a CUDA mesh: local chunks copied device-to-host into pinned
    slots, restored onto the GPU bit-exactly (FSDP2 on every GPU there is)."""
    world = torch.cuda.device_count() if mode == "fsdp" else need
    if torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} GPUs")
    _check(mode, world, _run(mode, world, ram_root, tmp_path, device="cuda"), "cuda")


def _reranked(rank: int, world: int, port: int, out: str, forget: bool) -> None:
    """Rank ``rank`` of one process group, then rank ``world - 1 - rank`` of the next, in
    the same process (as a survivor after a resize, or a kept worker), each time with an
    FSDP2-sharded parameter and a ``distribute_tensor``: their chunk records, and whether
    the parameter's mesh is the new group's. ``forget``: the worker's reset between groups
    (what memckpt's worker does); without it torch hands the parameter the old group's mesh
    (a cached spec), whose chunk memckpt must refuse to record."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from memckpt.errors import StateError
    from memckpt.format.dtensor import chunk_meta
    from memckpt.runtime.worker.worker import reset_framework_state

    records = []
    for group, r in enumerate((rank, world - 1 - rank)):
        if forget:
            reset_framework_state()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port + group}",
                                rank=r, world_size=world, timeout=timedelta(seconds=60))
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        t = distribute_tensor(torch.zeros(7, 2), mesh, [Shard(0)])
        layer = torch.nn.Linear(2, 9, bias=False)
        fully_shard(layer, mesh=mesh)
        try:
            param: object = chunk_meta(layer.weight)["offsets"]
        except StateError as e:
            param = str(e)
        records.append((r, chunk_meta(t)["offsets"], param, layer.weight.device_mesh is mesh))
        dist.destroy_process_group()
    Path(f"{out}.{rank}.json").write_text(json.dumps(records))


@pytest.mark.timeout(240)
def test_a_process_that_becomes_another_rank_records_that_ranks_chunk(tmp_path):
    out = str(tmp_path / "rec")
    _procs.spawn(_reranked, 3, out, True)
    for rank in range(3):
        for r, offsets, param, own_mesh in json.loads(Path(f"{out}.{rank}.json").read_text()):
            assert offsets == [[0, 3, 6][r], 0], (rank, r, offsets)
            assert param == [[0, 3, 6][r], 0], (rank, r, param)  # 9 rows: 3 a rank
            assert own_mesh, (rank, r)


@pytest.mark.timeout(240)
def test_a_parameter_on_an_earlier_groups_mesh_is_refused_not_recorded_wrong(tmp_path):
    """Without the reset, torch gives the second group's FSDP parameter the first group's
    mesh (the process's old rank): memckpt names the fix instead of recording that rank's
    offsets as this one's (a restore would then read rows from the wrong place)."""
    out = str(tmp_path / "rec")
    _procs.spawn(_reranked, 3, out, False)
    for rank in range(3):
        first, second = json.loads(Path(f"{out}.{rank}.json").read_text())
        assert first[2] == [[0, 3, 6][first[0]], 0] and first[3]
        r, offsets, param, own_mesh = second
        assert offsets == [[0, 3, 6][r], 0]  # a tensor distributed afresh is right
        if r != first[0]:  # the middle rank keeps its place: its old mesh is still right
            assert not own_mesh, "torch no longer reuses the old mesh: drop forget_meshes?"
            assert "forget_meshes()" in param and f"it is rank {r}" in param, param
