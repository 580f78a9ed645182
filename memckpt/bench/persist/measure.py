"""The measurements of ``memckpt bench persist`` (see :mod:`memckpt.bench.persist`): one
real shard per size, written by memckpt's tier and raw, each timed ``repeats`` times."""


from __future__ import annotations

import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any, Optional

from memckpt.bench.common import ram_dir
from memckpt.bench.persist.rows import rows_at


def _shard(size: int, ram_root: str) -> tuple[Any, Any]:
    import torch

    import memckpt
    n = max(8, int((size / 12) ** 0.5))  # params + 2 AdamW moments, fp32
    model = torch.nn.Linear(n, n, bias=False)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, n)).sum().backward()
    opt.step()
    ckpt = memckpt.Checkpointer(memckpt.Config(job_name="bench-persist", ram_root=ram_root))
    state = memckpt.TrainState(model, opt)
    ckpt.step(state, 1)
    ckpt.wait()
    with ckpt.engine.reading(1) as shard:
        raw = shard.raw.copy()
    ckpt.close(unlink=True)
    return raw, ckpt


def write_fsync(path: Path, data) -> None:
    """The raw disk limit: one ``write`` of ``data`` (bytes-like) + ``fsync``."""
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())


def _time(fn, repeats: int) -> float:
    return median(_timed(fn) for _ in range(repeats))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_persist_bench(sizes: list[int], repeats: int = 3, directory: Optional[str] = None,
                      s3: Optional[str] = None) -> list[dict[str, Any]]:
    from memckpt.persist import CheckpointStore
    rows = []
    base = Path(tempfile.mkdtemp(prefix="memckpt-bench-persist-", dir=directory))
    ram = str(ram_dir("memckpt-bench-"))
    try:
        for size in sizes:
            raw, _ = _shard(size, ram)
            store = CheckpointStore(str(base / "store"), keep_last=1)

            def memckpt_disk() -> None:  # the shard is step 1: rewrite it (manifest first)
                entry = store.write_shard(1, 0, raw, verify=False, replace=True)
                store.commit(1, 1, [entry], "bench")

            def raw_disk() -> None:
                write_fsync(base / "raw.bin", raw)

            times = {name: _time(fn, repeats)
                     for name, fn in (("raw-disk-write", raw_disk), ("memckpt-disk", memckpt_disk))}
            if s3:
                times.update(_s3_times(s3, raw, repeats))
            rows += [r.to_dict() for r in rows_at(len(raw), times)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
    return rows


def _s3_times(uri: str, raw: Any, repeats: int) -> dict[str, float]:
    from memckpt.persist import CheckpointStore, S3Backend
    store = CheckpointStore(uri, keep_last=1)
    backend = S3Backend(uri)
    client = backend.client
    bucket, _, prefix = uri[5:].partition("/")

    def memckpt_s3() -> None:
        store.commit(1, 1, [store.write_shard(1, 0, raw, verify=False, replace=True)], "bench")

    def raw_s3() -> None:
        client.upload_fileobj(io.BytesIO(memoryview(raw)), bucket, f"{prefix}/raw.bin".lstrip("/"))

    return {name: _time(fn, repeats)
            for name, fn in (("raw-s3-upload", raw_s3), ("memckpt-s3", memckpt_s3))}
