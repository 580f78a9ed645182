"""The measurements of ``memckpt bench reshard`` (see :mod:`memckpt.bench.reshard`): 4 writer
processes, then each (source, new world size)'s reader processes."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Optional

from memckpt.bench.common import end_rank_process, machine_info, spawn_failure
from memckpt.bench.reshard.rows import Row
from memckpt.bench.snapshot.measure import peak_rss, reset_peak_rss, rss_bytes

WRITERS = 4
LAYERS = 8


def _width(total: int) -> int:
    """Hidden width of LAYERS square layers whose weights + 2 AdamW moments (fp32) are ~total."""
    return max(8, int((total / (3 * 4 * LAYERS)) ** 0.5))


def _model(width: int, world: int, meta: bool = False):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta" if meta else "cpu"):
        net = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(LAYERS)])
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    if meta:
        net.to_empty(device="cpu")
    return net, torch.optim.AdamW(net.parameters(), lr=1e-3)


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def _writer(rank: int, world: int, port: int, width: int, work: str, store: Any) -> None:
    """One of the 4 writing ranks: a step of AdamW, then memckpt's shard (disk tier and a
    replica store's RAM) and a DCP checkpoint of the same state."""
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    import memckpt
    from memckpt.persist import CheckpointStore
    from memckpt.runtime.wire.data_plane import StoreConnection
    try:
        _init(rank, world, port)
        torch.manual_seed(rank)
        model, opt = _model(width, world)
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        state = memckpt.TrainState(model=model, optimizer=opt, rng=False)
        cfg = memckpt.Config(job_name="bench-reshard", ram_root=f"{work}/ram-w")
        ckpt = memckpt.Checkpointer(cfg, rank, world)  # no tier: nothing persisted
        ckpt.step(state, 1)
        ckpt.wait()
        with ckpt.engine.reading(1) as shard:
            CheckpointStore(f"{work}/disk").write_shard(1, rank, shard.raw, verify=False)
            conn = StoreConnection(tuple(store))
            conn.send(rank, 1, shard.raw, shard.header["data_xxh3"], gen=-1, chunks=shard.chunks)
            conn.close()
        ckpt.close(unlink=True)
        dcp.save({"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=f"{work}/dcp")
        dist.barrier()
    except BaseException:
        Path(work, f"error-w{rank}.txt").write_text(traceback.format_exc())
        raise
    end_rank_process()


def _reader(rank: int, world: int, port: int, width: int, work: str, source: str,
            holders: Any) -> None:
    """One restoring rank: restore from ``source`` (disk, ram, dcp), time it, peak RSS."""
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    import memckpt
    from memckpt.config import CONTENT_KINDS
    from memckpt.format.dcp_reader import MemckptReader
    from memckpt.persist import CheckpointStore
    from memckpt.persist.dcp_source import PersistedSource, newest_manifest
    from memckpt.format.reshard import load_resharded
    from memckpt.runtime.worker.ram_source import ReplicaSource
    try:
        _init(rank, world, port)
        model, opt = _model(width, world, meta=True)
        shard_bytes = 3 * sum(p.to_local().numel() * 4 for p in model.parameters())
        dist.barrier()
        # The high-water mark from here on: ru_maxrss would also count the parent's RSS at
        # fork (Linux keeps it across exec), which at 1 GiB hid every restore's own peak.
        reset_peak_rss()
        before = rss_bytes()
        t0 = time.perf_counter()
        read = 0
        if source == "dcp":
            sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(sd, checkpoint_id=f"{work}/dcp")
            set_optimizer_state_dict(model, opt, sd["optim"])
        else:
            if source == "disk":
                store = CheckpointStore(f"{work}/disk")
                src: Any = PersistedSource(store, newest_manifest(store))
            else:
                src = ReplicaSource(holders, WRITERS, 1)
            state = memckpt.TrainState(model=model, optimizer=opt, rng=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                load_resharded(state, MemckptReader(src), rank, frozenset(CONTENT_KINDS))
            read = src.bytes_read
        seconds = time.perf_counter() - t0
        peak = peak_rss()  # VmHWM (ru_maxrss where /proc is missing)
        torch.save({"seconds": seconds, "peak_rss": peak, "rss_before": before, "read": read,
                    "shard_bytes": shard_bytes}, f"{work}/r-{source}-{world}-{rank}.pt")
        dist.barrier()
    except BaseException:
        Path(work, f"error-r{rank}.txt").write_text(traceback.format_exc())
        raise
    end_rank_process()


def _spawn(fn, world: int, work: str, *args: Any) -> None:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    from memckpt.util.netutil import free_port
    try:
        mp.start_processes(fn, args=(world, free_port(), *args), nprocs=world, join=True,
                           start_method="spawn")
    except ProcessException as e:
        raise spawn_failure(f"{fn.__name__.strip('_')} ranks (world {world})", work, e) from e


def run_reshard_bench(size: int, worlds: tuple[int, ...] = (2, 3),
                      directory: Optional[str] = None) -> list[dict[str, Any]]:
    """Rows: one per (source, new world size)."""
    import torch

    from memckpt.format import shard as fmt
    from memckpt.persist import CheckpointStore, ShardEntry
    from memckpt.runtime.node.replica_store import ReplicaStore
    work = tempfile.mkdtemp(prefix="memckpt-bench-reshard-", dir=directory)
    width = _width(size)
    try:
        store = ReplicaStore(f"{work}/ram", "bench-reshard", "node")
        address = store.address("127.0.0.1")
        _spawn(_writer, WRITERS, work, width, work, address)
        disk = CheckpointStore(f"{work}/disk")
        entries = []
        for rank in range(WRITERS):
            key = f"{disk.folder_for(1)}/rank-{rank:05d}.shard"
            end = fmt.header_end(disk.backend.get_range(key, 0, fmt.PREFIX.size), key)
            head = disk.backend.get_range(key, 0, end)
            h, layout, cap = fmt.read_header(head, key, check_length=False)
            entries.append(ShardEntry(rank, key, fmt.data_offset(cap) + layout.data_len, h["data_xxh3"]))
        disk.commit(1, WRITERS, entries, "bench")
        total = sum(e.size for e in entries)
        holders = {r: [address] for r in range(WRITERS)}
        rows = []
        for world in worlds:
            for source in ("ram", "disk", "dcp"):
                _spawn(_reader, world, work, width, work, source, holders)
                per_rank = [torch.load(f"{work}/r-{source}-{world}-{r}.pt") for r in range(world)]
                rows.append(Row(
                    source, WRITERS, world, total, max(p["seconds"] for p in per_rank),
                    sum(p["read"] for p in per_rank) or None,
                    max(p["peak_rss"] for p in per_rank),
                    max(p["peak_rss"] - p["rss_before"] for p in per_rank),
                    max(p["shard_bytes"] for p in per_rank), machine_info()))
        store.clear()
        return [r.to_dict() for r in rows]
    finally:
        shutil.rmtree(work, ignore_errors=True)
