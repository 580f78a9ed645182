"""Persistence throughput: memckpt's tier writes vs a raw write of the same bytes.

For each size, one real shard (a model + AdamW state snapshotted by a
``Checkpointer``) is written

  disk:  ``CheckpointStore.write_shard`` + manifest commit, vs one file written
         with ``write`` + ``fsync`` (the raw limit of the same filesystem)
  s3:    the same store on an S3 URI, vs one boto3 ``upload_fileobj`` of the same
         bytes to the same endpoint (``--s3 URI``; endpoint and credentials from the
         AWS environment, e.g. ``AWS_ENDPOINT_URL``)

and the ratio raw-time / memckpt-time is reported (target >= 70%).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any, Optional

from memckpt.bench.common import parse_size, positive_int, ram_dir, usable_dir, write_rows


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

            for name, fn in (("raw-disk-write", raw_disk), ("memckpt-disk", memckpt_disk)):
                rows.append({"benchmark": "persist", "method": name, "state_bytes": len(raw),
                             "median_s": _time(fn, repeats)})
            if s3:
                rows += _s3_rows(s3, raw, repeats)
            raw_t = {r["method"]: r["median_s"] for r in rows if r["state_bytes"] == len(raw)}
            for r in rows:
                if r["state_bytes"] == len(raw):
                    limit = raw_t["raw-s3-upload"] if "s3" in r["method"] else raw_t["raw-disk-write"]
                    r["throughput_Bps"] = len(raw) / r["median_s"]
                    r["fraction_of_raw"] = limit / r["median_s"]
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
    return rows


def _s3_rows(uri: str, raw, repeats: int) -> list[dict[str, Any]]:
    from memckpt.persist import CheckpointStore, S3Backend
    store = CheckpointStore(uri, keep_last=1)
    backend = S3Backend(uri)
    client = backend.client
    bucket, _, prefix = uri[5:].partition("/")
    def memckpt_s3() -> None:
        store.commit(1, 1, [store.write_shard(1, 0, raw, verify=False, replace=True)], "bench")

    def raw_s3() -> None:
        client.upload_fileobj(io.BytesIO(memoryview(raw)), bucket, f"{prefix}/raw.bin".lstrip("/"))

    return [{"benchmark": "persist", "method": name, "state_bytes": len(raw),
             "median_s": _time(fn, repeats)}
            for name, fn in (("raw-s3-upload", raw_s3), ("memckpt-s3", memckpt_s3))]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", default=[1 << 30], metavar="LIST",
                        type=lambda text: [parse_size(t) for t in text.split(",")],
                        help="shard sizes, comma-separated, e.g. 100M,1G (default 1G)")
    parser.add_argument("--repeats", type=positive_int, default=3, metavar="N",
                        help="timed repeats per method; medians are reported (default 3)")
    parser.add_argument("--dir", help="where the disk tier lives (default: the temp dir, on disk)")
    parser.add_argument("--s3", metavar="URI", help="also measure an S3 tier at this s3://bucket/prefix")
    parser.add_argument("--json", metavar="PATH", help="write the rows as JSON")


def main(args: argparse.Namespace) -> int:
    if args.dir:
        usable_dir(args.dir)
    rows = run_persist_bench(args.sizes, args.repeats, args.dir, args.s3)
    print("| method | shard | median | throughput | fraction of raw |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['method']} | {r['state_bytes'] / 2**20:.0f} MiB | {r['median_s']:.3f} s | "
              f"{r['throughput_Bps'] / 1e9:.2f} GB/s | {100 * r['fraction_of_raw']:.0f}% |")
    write_rows(args.json, rows, indent=1)
    return 0
