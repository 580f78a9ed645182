"""Multi-rank jobs (torch.multiprocessing, gloo) for the resharding tests: one writes a
persisted checkpoint with N ranks in one layout, another restores it into M ranks in
another; both dump every parameter and optimizer tensor gathered to full."""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

import memckpt
from memckpt.persist import CheckpointStore, ShardEntry
from memckpt.format import shard as fmt

DIM, OUT = 16, 4
HIDDEN = int(os.environ.get("MEMCKPT_TEST_HIDDEN", "24"))
LAYOUTS = ("ddp", "zero", "fsdp", "tp", "single")


def build(layout: str, seed: int) -> tuple[torch.nn.Module, Any, torch.nn.Module]:
    """(the model as trained, its optimizer, the plain module inside)."""
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
                              torch.nn.Linear(HIDDEN, OUT))
    model: torch.nn.Module = net
    if layout == "ddp" or layout == "zero":
        model = torch.nn.parallel.DistributedDataParallel(net)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    elif layout == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        parallelize_module(net, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    if layout == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt, net


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(32, DIM, generator=g), torch.randn(32, OUT, generator=g)


def train_step(model, opt, rank: int) -> float:
    x, y = batch(0)  # the same data on every rank: TP needs it, and losses compare
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    loss = loss.detach()
    return float(loss.full_tensor() if hasattr(loss, "full_tensor") else loss)


def full_state(state: memckpt.TrainState) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer tensor this rank can give, gathered to full
    (``full_tensor()`` for DTensors; ZeRO: the state of the parameters it owns)."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
    out = {}
    for name, p in sorted(state.named_params().items()):
        out[f"param/{name.split('/', 1)[1].removeprefix('module.')}"] = full(p)
    for oname in state.optimizers:
        opt = state.local_optimizer(oname)
        names = {id(p): n for n, p in state.named_params().items()}
        for group in opt.param_groups:
            for p in group["params"]:
                for k, v in sorted(opt.state.get(p, {}).items()):
                    if isinstance(v, torch.Tensor):
                        key = names[id(p)].split("/", 1)[1].removeprefix("module.")
                        out[f"optim/{key}/{k}"] = full(v)
    return out


def _init(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


class _Unpersisted(memckpt.Checkpointer):
    """The job's Checkpointer, its config's tier left to this script (it stores the shards)."""

    def _make_persister(self) -> None:
        return None


def _config(root: str, ram: str, **load: Any) -> memckpt.Config:
    return memckpt.Config(job_name="reshard", ram_root=ram, persistence=[memckpt.PersistTier(root)],
                          load=memckpt.LoadSpec(**load))


@contextmanager
def _rank(rank: int, world: int, port: int, layout: str, out: str) -> Iterator[None]:
    """One rank's process: join the group (unless ``single``), run the body, leave it
    together; a failure's traceback goes to ``out/error-<rank>.txt`` for the test to show."""
    try:
        if layout != "single":
            _init(rank, world, port)
        yield
        if layout != "single":
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def reported_loss(rank: int) -> float:
    """The loss ``write_job``'s rank reports for its snapshot's step (each rank another)."""
    return 0.25 + rank


def write_job(rank: int, world: int, port: int, layout: str, root: str, ram: str, out: str,
              steps: int, stores: Any = None) -> None:
    """Train ``steps`` steps, snapshot, store this rank's shard under ``root`` (or, with
    ``stores``, stream it to those replica stores as replication does)."""
    with _rank(rank, world, port, layout, out):
        model, opt, _ = build(layout, seed=0)
        state = memckpt.TrainState(model=model, optimizer=opt)
        for _ in range(steps):
            train_step(model, opt, rank)
        ckpt = _Unpersisted(_config(root, ram), rank, world)
        ckpt.snapshot(state, steps, report={"loss": reported_loss(rank)})
        ckpt.wait()
        with ckpt.engine.reading(steps) as shard:
            if stores:
                from memckpt.runtime.wire.data_plane import StoreConnection
                for address in stores[rank]:
                    conn = StoreConnection(tuple(address))
                    conn.send(rank, steps, shard.raw, shard.header["data_xxh3"], gen=-1,
                              chunks=shard.chunks)
                    conn.close()
            else:
                CheckpointStore(root).write_shard(steps, rank, shard.raw)
        torch.save(full_state(state), Path(out) / f"before-{rank}.pt")
        ckpt.close(unlink=True)


def restore_job(rank: int, world: int, port: int, layout: str, root: str, ram: str, out: str,
                more: int, load: dict[str, Any]) -> None:
    """Restore from ``root`` (auto-resume, resharding), dump the state, train ``more`` steps."""
    with _rank(rank, world, port, layout, out):
        model, opt, _ = build(layout, seed=123)  # different initial values
        state = memckpt.TrainState(model=model, optimizer=opt)
        ckpt = memckpt.Checkpointer(_config(root, ram, **load), rank, world)
        step = ckpt.restore(state)
        torch.save({"step": step, "state": full_state(state),
                    "events": [e for e in ckpt.events if e["event"] != "restored"],
                    "report": ckpt.restored_report},
                   Path(out) / f"after-{rank}.pt")
        losses = [train_step(model, opt, rank) for _ in range(more)]
        torch.save(losses, Path(out) / f"losses-{rank}.pt")
        ckpt.close(unlink=True)


def commit(root: str, step: int, world: int) -> None:
    """Commit the shards the ranks stored (what the coordinator does in a Ray job)."""
    store = CheckpointStore(root)
    folder = store.folder_for(step)
    entries = []
    for rank in range(world):
        key = f"{folder}/rank-{rank:05d}.shard"
        raw = store.backend.get(key)
        h, _, _ = fmt.read_header(raw, key)
        entries.append(ShardEntry(rank=rank, key=key, size=len(raw), checksum=h["data_xxh3"]))
    fingerprint = _config(root, "/tmp").fingerprint()
    store.commit(step, world, entries, fingerprint, job="reshard")


def merged(out: Path, prefix: str, world: int) -> dict[str, torch.Tensor]:
    """One dict from every rank's dump; tensors two ranks both give must be equal."""
    full: dict[str, torch.Tensor] = {}
    for rank in range(world):
        d = torch.load(out / f"{prefix}-{rank}.pt", weights_only=False)
        d = d["state"] if "state" in d else d
        for k, v in d.items():
            if k in full:
                assert torch.equal(full[k], v), f"ranks disagree on {k}"
            full[k] = v
    return full


def dcp_job(rank: int, world: int, port: int, layout: str, root: str, out: str) -> None:
    """``dcp.load`` through memckpt's reader with torchtitan's keys (no memckpt restore)."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)
    with _rank(rank, world, port, layout, out):
        model, opt, _ = build(layout, seed=123)
        sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            plain = (Path(root) / ".metadata").exists()  # written by `memckpt export --dcp`
            dcp.load(sd, storage_reader=dcp.FileSystemReader(root) if plain
                     else memckpt.dcp_reader(root))
        model.load_state_dict(sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        state = memckpt.TrainState(model=model, optimizer=opt)
        torch.save({"state": full_state(state)}, Path(out) / f"after-{rank}.pt")


def ram_restore_job(rank: int, world: int, port: int, layout: str, holders: Any, n: int,
                    step: int, out: str, more: int) -> None:
    """Restore step ``step`` of an ``n``-rank job from replica stores' RAM into this layout."""
    from memckpt.config import CONTENT_KINDS
    from memckpt.format.dcp_reader import MemckptReader
    from memckpt.format.reshard import load_resharded, reported
    from memckpt.runtime.worker.ram_source import ReplicaSource
    with _rank(rank, world, port, layout, out):
        model, opt, _ = build(layout, seed=123)
        state = memckpt.TrainState(model=model, optimizer=opt)
        source = ReplicaSource(holders, n, step)
        reader = MemckptReader(source)
        got = load_resharded(state, reader, rank, frozenset(CONTENT_KINDS))
        source.close()
        torch.save({"step": got, "state": full_state(state), "bytes_read": source.bytes_read,
                    "report": reported(reader)}, Path(out) / f"after-{rank}.pt")
        losses = [train_step(model, opt, rank) for _ in range(more)]
        torch.save(losses, Path(out) / f"losses-{rank}.pt")
