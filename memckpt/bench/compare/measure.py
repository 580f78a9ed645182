"""The measurements of ``memckpt bench compare`` (see :mod:`memckpt.bench.compare`): the stall
of every method (the plain ones in a fresh process, memckpt.run and Ray Train on a local
cluster), recovery on a local 3-node cluster, and memckpt's scaling over nodes."""

from __future__ import annotations

import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

from memckpt.bench.common import GIB, ram_dir, rows_from_child
from memckpt.bench.compare.rows import (BASELINE_NODE, RECOVERY_METHODS, raytrain_suffix,
                                        recovery_rows, scaling_rows, stall_rows)
from memckpt.bench.recovery.measure import connect_driver
from memckpt.runtime.driver.kept import keep_workers

PLAIN = ("none", "memcpy", "raw-disk-write", "memckpt-local", "torch.save", "dcp-async")
SELECTABLE = PLAIN[1:] + ("memckpt", "ray-train")  # --methods (the baselines come along)


def _plain_in_subprocess(size: int, steps: int, warmup: int, compute_n: int, directory: Path,
                         ram_root: str, methods: tuple[str, ...] = PLAIN) -> dict[str, Any]:
    """The plain-process methods at one size in a fresh process (memory returned afterwards)."""
    return rows_from_child(
        "memckpt.bench.compare.alternatives",
        ["--size", str(size), "--steps", str(steps), "--warmup", str(warmup), "--compute-n",
         str(compute_n), "--dir", str(directory), "--ram-root", ram_root, "--methods",
         ",".join(methods)], "--out", f"the plain methods at {size} bytes")


def _fits(need: int) -> bool:
    import psutil
    return psutil.virtual_memory().available > need


def measure_stall(sizes: list[tuple[str, int]], steps: int, warmup: int, compute_n: int,
                  directory: Path, ram_root: str, raytrain_poll_s: Optional[float],
                  log: Callable[[str], None],
                  only: tuple[str, ...] = SELECTABLE) -> list[dict[str, Any]]:
    from memckpt.bench.compare import alternatives as alt
    from memckpt.runtime.tools.local_cluster import LocalCluster
    raw: dict[str, dict[str, Any]] = {}
    plain = tuple(m for m in PLAIN if m == "none" or m in only)
    for label, size in sizes:
        raw[label] = {"methods": {}, "harness": {}, "state_bytes": None}
        if len(plain) > 1:
            log(f"stall {label}: plain methods in a fresh process")
            raw[label] = _plain_in_subprocess(size, steps, warmup, compute_n, directory, ram_root,
                                              plain)
            raw[label]["harness"] = {m: "process" for m in raw[label]["methods"]}
    if "memckpt" not in only and "ray-train" not in only:
        return [r for label, _ in sizes for r in stall_rows(label, raw[label], steps, raytrain_poll_s)]
    log("stall: starting a local 2-node cluster (2 CPUs each) for memckpt.run and Ray Train")
    cluster = LocalCluster(nodes=2, cpus_per_node=alt.TORCH_THREADS, object_store_mb=512)
    run_dir = Path(tempfile.mkdtemp(prefix="memckpt-compare-runs-"))
    storage = Path(tempfile.mkdtemp(prefix="compare-raytrain-storage-", dir=directory))
    try:
        connect_driver(cluster)
        for label, size in sizes:
            methods = raw[label]["methods"]
            # memckpt: live state + 2 own slots on node 0, 2 replica slots on node 1
            if "memckpt" not in only:
                pass
            elif _fits(int(5.3 * size) + 3 * GIB):
                # the second job takes the first one's worker processes (their steps are
                # timed after the warm-up); they are gone before Ray Train needs the CPUs
                with keep_workers():
                    for snap in (False, True):
                        name = f"cmp-stall-{label.lower()}-{'on' if snap else 'off'}-{os.getpid()}"
                        log(f"stall {label}: memckpt.run, snapshots {'on' if snap else 'off'}")
                        gc.collect()
                        r = alt.memckpt_stall(alt.StallJob(size, steps, warmup, compute_n),
                                              snapshots=snap, workers=2, replicas=1,
                                              ram_root=ram_root, run_dir=run_dir, name=name,
                                              cpus_per_worker=alt.TORCH_THREADS)
                        key = "memckpt" if snap else "memckpt-none"
                        methods[key] = r
                        raw[label]["state_bytes"] = raw[label]["state_bytes"] or r["state_bytes"]
                        raw[label]["harness"][key] = "memckpt.run"
            else:
                log(f"stall {label}: not enough free RAM for memckpt with a replica: skipped")
            if "ray-train" not in only:
                pass
            elif _fits(int(2.2 * size) + 3 * GIB):
                for ck in (False, True):
                    log(f"stall {label}: Ray Train, checkpoint {'on' if ck else 'off'}")
                    with alt.raytrain_poll(raytrain_poll_s):
                        r = alt.raytrain_stall(size, steps, warmup, compute_n, checkpoint=ck,
                                               storage=storage, local_dir=directory,
                                               name=f"cmp-rt-{label.lower()}-{int(ck)}-{os.getpid()}")
                    name = ("ray-train" if ck else "ray-train-none") + raytrain_suffix(raytrain_poll_s)
                    methods[name] = r
                    raw[label]["state_bytes"] = raw[label]["state_bytes"] or r.get("state_bytes")
                    raw[label]["harness"][name] = "TorchTrainer"
            else:
                log(f"stall {label}: not enough free RAM for Ray Train: skipped")
    finally:
        cluster.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
        shutil.rmtree(storage, ignore_errors=True)
    rows = []
    for label, _size in sizes:
        rows += stall_rows(label, raw[label], steps, raytrain_poll_s)
    return rows


def measure_recovery(sizes: list[tuple[str, int]], repeats: int, directory: Path,
                     raytrain_poll_s: Optional[float], compute_iters: int, kill_at: int,
                     log: Callable[[str], None], cluster: Any = None,
                     methods: tuple[str, ...] = RECOVERY_METHODS) -> list[dict[str, Any]]:
    """``cluster``: a LocalCluster of ``rec.NODES`` nodes x ``rec.CPUS_PER_NODE`` CPUs to use
    (left running), else one is started here and shut down after. ``methods``: the
    recoveries to measure (of :data:`RECOVERY_METHODS`)."""
    from memckpt.bench.compare import alternatives as alt
    from memckpt.bench.recovery import measure as rec
    from memckpt.bench.recovery.bench_actors import ColdWorker
    from memckpt.bench.recovery.workload import DEFAULT_LAYERS
    from memckpt.runtime.tools.local_cluster import LocalCluster
    biggest = max(s for _, s in sizes)
    store_mb = max(256, int(1.25 * biggest / 2**20) + 128)
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    own = cluster is None
    if own:
        log(f"recovery: starting a local {rec.NODES}-node cluster (object store {store_mb} MiB "
            "per node)")
        cluster = LocalCluster(nodes=rec.NODES, cpus_per_node=rec.CPUS_PER_NODE,
                               object_store_mb=store_mb)
    disk = Path(tempfile.mkdtemp(prefix="memckpt-compare-recovery-", dir=directory))
    ram_root = ram_dir("memckpt-compare-recovery-")
    run_root = Path(tempfile.mkdtemp(prefix="memckpt-compare-recovery-runs-"))
    rows: list[dict[str, Any]] = []
    try:
        connect_driver(cluster)
        for label, size in sizes:
            # 2 ranks x (live state + 2 own slots + 2 replica slots) + a peer fetch's copy;
            # recovery.memory_needed adds a removed node's files, which are freed here at once
            need = 11 * size + 4 * GIB
            if not _fits(need):
                log(f"recovery {label}: needs ~{need / GIB:.0f} GiB free: skipped")
                continue
            b = rec.RecoveryBench(cluster, size, DEFAULT_LAYERS, kill_at, 2, compute_iters, disk,
                           ram_root, run_root, log)
            b.restore_nodes()
            samples: dict[str, list[dict[str, Any]]] = {m: [] for m in RECOVERY_METHODS}
            raw: list[dict[str, Any]] = []
            for rep in range(repeats):
                log(f"recovery {label}: repeat {rep + 1}/{repeats}")
                if "memckpt-worker" in methods:
                    samples["memckpt-worker"].append(b.memckpt_recovery("worker", rep))
                if "memckpt-node" in methods:
                    try:
                        s = b.memckpt_recovery("node", rep)
                        samples["memckpt-node"].append(s)
                        if "peer_fetch" in s:
                            pf = s["peer_fetch"]
                            raw.append(b.raw_transfer(pf["src"], pf["dst"], pf["bytes"]))
                    finally:
                        b.restore_nodes()
                if "restart+torch.load" in methods:
                    samples["restart+torch.load"].append(b.restart_baseline(rep))
                if BASELINE_NODE in methods:
                    try:  # memckpt-node's failure, for the alternative
                        samples[BASELINE_NODE].append(
                            b.restart_baseline(rep, ColdWorker, node_loss=True))
                    finally:
                        b.restore_nodes()
                if "restart+dcp.load" in methods:
                    samples["restart+dcp.load"].append(alt.dcp_recovery(b, rep))
                    log(f"restart+dcp.load: total "
                        f"{samples['restart+dcp.load'][-1]['total_s']:.2f} s")
                if "ray-train-restore" in methods:
                    with alt.raytrain_poll(raytrain_poll_s):
                        s = alt.raytrain_recovery(
                            b.d, b.n, kill_at, compute_iters, disk, disk,
                            f"cmp-rt-rec-{label.lower()}-{rep}-{os.getpid()}", rec.CPUS_PER_NODE)
                    samples["ray-train-restore"].append(s)
                    log(f"ray-train-restore: total {s['total_s']:.2f} s ({s['phases_s']})")
            rows += recovery_rows(label, b.state_bytes, samples, raw, raytrain_poll_s)
    finally:
        if own:
            cluster.shutdown()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(ram_root, ignore_errors=True)
        shutil.rmtree(run_root, ignore_errors=True)
    return rows


def measure_scaling(size: int, label: str, node_counts: list[int], steps: int, warmup: int,
                    compute_n: int, ram_root: str, log: Callable[[str], None],
                    cluster: Any = None) -> list[dict[str, Any]]:
    """``cluster``: a LocalCluster of at least ``max(node_counts)`` nodes x 2 CPUs to use (left
    running), else one is started here and shut down after."""
    from memckpt.runtime.tools.local_cluster import LocalCluster
    own = cluster is None
    if own:
        log(f"scaling: starting a local {max(node_counts)}-node cluster")
        cluster = LocalCluster(nodes=max(node_counts), cpus_per_node=2, object_store_mb=512)
    run_dir = Path(tempfile.mkdtemp(prefix="memckpt-compare-runs-"))
    rows: list[dict[str, Any]] = []
    try:
        connect_driver(cluster)
        with keep_workers():  # each job takes the worker processes the one before it left
            rows = _scaling_jobs(size, label, node_counts, steps, warmup, compute_n, ram_root,
                                 run_dir, log)
    finally:
        if own:
            cluster.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


def _scaling_jobs(size: int, label: str, node_counts: list[int], steps: int, warmup: int,
                  compute_n: int, ram_root: str, run_dir: Path,
                  log: Callable[[str], None]) -> list[dict[str, Any]]:
    from memckpt.bench.compare import alternatives as alt
    rows: list[dict[str, Any]] = []
    for nodes in sorted(node_counts):
        base: Optional[float] = None
        for k in (0, 1, 2):
            if k >= nodes:
                continue
            if not _fits(int((2 + 2 * k + 1.3) * size * nodes) + 3 * GIB):
                log(f"scaling: {nodes} nodes, k={k}: not enough free RAM: skipped")
                continue
            name = f"cmp-scale-{nodes}-{k}-{os.getpid()}"
            log(f"scaling: {nodes} nodes, k={k}" if k else f"scaling: {nodes} nodes, no snapshots")
            job = alt.StallJob(size, steps, warmup, compute_n, full_ranks=nodes, threads=1)
            r = alt.memckpt_stall(job, snapshots=k > 0, workers=nodes, replicas=max(1, k),
                                  ram_root=ram_root, run_dir=run_dir, name=name,
                                  cpus_per_worker=2)
            rows += scaling_rows(label, nodes, k, r, base)
            if k == 0:
                base = rows[-1]["step_s"]
    return rows

