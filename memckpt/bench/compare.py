"""Side by side: memckpt against torch.save, DCP async_save and Ray Train checkpoints.

Four parts (``--parts``, default all), each measured in this run, medians over repeats:

  stall      per-step stall of checkpointing every step, at each ``--sizes`` (params + AdamW
             state), with a fixed simulated forward+backward per step (``--step-s``, the same
             matmuls for every method). Stall = max(step-time increase over the same harness
             without checkpoints, the blocking part of the call): background work that steals
             the CPU shows up; the blocking part counts beyond the same harness's call
             without a checkpoint (Ray Train's report() alone waits for its controller's
             2 s poll). Methods: none, memckpt-local (RAM copy only), memckpt
             (memckpt.run, replication to a peer node's store every step), torch.save (local
             disk + fsync), dcp-async (the blocking part of dcp.async_save, incl. waiting for
             the previous save), ray-train (torch.save into a dir + ray.train.report); the
             physical limits in the same run: memcpy of the same tensors and one raw file
             write + fsync of the same bytes.
  lost_work  derived from the stall part (no extra measurement): per method, the smallest
             checkpoint interval N (steps) whose cost stays <= 5% of the step time, and the
             expected recomputed steps per failure, N/2 + the steps until a checkpoint is
             recoverable (replication / background write lag) (CheckFreq's and Gemini's
             argument)
  recovery   a 2-rank job (state per rank = each ``--recovery-sizes``) on a local 3-node Ray
             cluster, rank 1 SIGKILLed; fault -> every rank finished its first resumed step:
             memckpt from the local store and from a peer store (node removed)
             (memckpt.bench.recovery), restart every worker + torch.load, the same with DCP
             (dcp.save / dcp.load), and Ray Train restoring from its storage_path; the peer
             restore is also shown against a raw TCP transfer of the same bytes, and against
             restart + torch.load after the same node loss (rank 1's node removed: Ray must
             declare it dead before anyone restarts)
  scaling    memckpt on ``--nodes`` simulated nodes (2,3,4) (one rank each, 1 torch thread,
             ``--scaling-size`` per rank), k = 1 and k = 2 replicas: stall, and the bytes each
             node's store holds (measured from the stores)

Sizes are binary (100M = 100 MiB). The simulated nodes are raylets on this one machine, so
every figure includes the CPU that replication and background writes take from training.
``--from-json A.json B.json`` merges rows of earlier (per-part) runs into one table and plot.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable, Optional

from memckpt.bench.common import (finish_report, human_bytes, human_s, machine_info, machine_line,
                                  positive_int, standalone, write_rows)
from memckpt.bench.recovery import BASELINE_NODE
from memckpt.bench.snapshot import calibrate_compute, parse_sizes, Quiet

PARTS = ("stall", "lost_work", "recovery", "scaling")
DEFAULT_SIZES = "100M,1G"
DEFAULT_STEP_S = 1.0
OVERHEAD_BUDGET = 0.05  # the interval a method can afford: cost <= 5% of the step time
STALL_METHODS = ("none", "memcpy", "raw-disk-write", "memckpt-local", "memckpt-none", "memckpt",
                 "torch.save", "dcp-async", "ray-train-none", "ray-train")
BASELINES = {"none", "memckpt-none", "ray-train-none"}
LIMITS = {"memcpy", "raw-disk-write"}
CHECKPOINT_METHODS = ("memckpt-local", "memckpt", "torch.save", "dcp-async", "ray-train")


def base_method(m: str) -> str:
    """Ray Train measured with a non-default controller poll is named ray-train-pollXs."""
    return "ray-train" if m.startswith("ray-train-poll") else \
        "ray-train-none" if m.startswith("ray-train-none") else m


def is_baseline(m: str) -> bool:
    return base_method(m) in BASELINES


def harness_base(m: str) -> str:
    """The same harness without checkpoints: what a method's step-time increase is against."""
    if m == "memckpt":
        return "memckpt-none"
    if m.startswith("ray-train"):
        return "ray-train-none" + m[len("ray-train"):]
    return "none"


def raytrain_suffix(poll_s: Optional[float]) -> str:
    return "" if poll_s is None or poll_s == 2.0 else f"-poll{poll_s:g}s"
RECOVERY_METHODS = ("memckpt-worker", "memckpt-node", "restart+torch.load", "restart+dcp.load",
                    "ray-train-restore", BASELINE_NODE)
ALTERNATIVES = ("restart+torch.load", "restart+dcp.load", "ray-train-restore")  # a killed worker
_GIB = 1 << 30

# the targets
TARGET_X_MEMCPY = 1.3
TARGET_VS_TORCH_SAVE = 10.0
TARGET_RECOVERY_SPEEDUP = 3.0
TARGET_LOST_STEPS = 1.0


def _log(msg: str) -> None:
    print(f"[bench compare] {msg}", file=sys.stderr, flush=True)


def _med(xs: list[float]) -> float:
    return float(median(xs))


# -- stall ----------------------------------------------------------------------------------------
PLAIN = ("none", "memcpy", "raw-disk-write", "memckpt-local", "torch.save", "dcp-async")
SELECTABLE = PLAIN[1:] + ("memckpt", "ray-train")  # --methods (the baselines come along)


def _plain_in_subprocess(size: int, steps: int, warmup: int, compute_n: int, directory: Path,
                         ram_root: str, methods: tuple[str, ...] = PLAIN) -> dict[str, Any]:
    """The plain-process methods at one size in a fresh process (memory returned afterwards)."""
    import memckpt
    env = dict(os.environ)
    root = str(Path(memckpt.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    fd, out = tempfile.mkstemp(prefix="memckpt-compare-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "memckpt.bench.alternatives", "--size", str(size), "--steps",
           str(steps), "--warmup", str(warmup), "--compute-n", str(compute_n), "--dir",
           str(directory), "--ram-root", ram_root, "--methods", ",".join(methods), "--out", out]
    try:
        proc = subprocess.run(cmd, env=env, stdout=sys.stderr.fileno() if _has_fd() else None,
                              stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise RuntimeError(f"the plain methods at {size} bytes exited with {proc.returncode}")
        return json.loads(Path(out).read_text())
    finally:
        os.unlink(out)


def _has_fd() -> bool:
    try:
        sys.stderr.fileno()
        return True
    except (AttributeError, ValueError, OSError):
        return False


def _connect(cluster: Any) -> None:
    import ray
    ray.shutdown()
    ray.init(address=cluster.cluster.address, namespace="memckpt", log_to_driver=False,
             logging_level="ERROR")


def _fits(need: int) -> bool:
    import psutil
    return psutil.virtual_memory().available > need


def measure_stall(sizes: list[tuple[str, int]], steps: int, warmup: int, compute_n: int,
                  directory: Path, ram_root: str, raytrain_poll_s: Optional[float],
                  log: Callable[[str], None],
                  only: tuple[str, ...] = SELECTABLE) -> list[dict[str, Any]]:
    from memckpt.bench import alternatives as alt
    from memckpt.runtime.local_cluster import LocalCluster
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
        _connect(cluster)
        for label, size in sizes:
            methods = raw[label]["methods"]
            # memckpt: live state + 2 own slots on node 0, 2 replica slots on node 1
            if "memckpt" not in only:
                pass
            elif _fits(int(5.3 * size) + 3 * _GIB):
                for snap in (False, True):
                    name = f"cmp-stall-{label.lower()}-{'on' if snap else 'off'}-{os.getpid()}"
                    log(f"stall {label}: memckpt.run, snapshots {'on' if snap else 'off'}")
                    gc.collect()
                    r = alt.memckpt_stall(size, steps, warmup, compute_n, snapshots=snap, workers=2,
                                          replicas=1, ram_root=ram_root, run_dir=run_dir, name=name,
                                          cpus_per_worker=alt.TORCH_THREADS)
                    methods["memckpt" if snap else "memckpt-none"] = r
                    raw[label]["state_bytes"] = raw[label]["state_bytes"] or r["state_bytes"]
                    raw[label]["harness"]["memckpt" if snap else "memckpt-none"] = "memckpt.run"
            else:
                log(f"stall {label}: not enough free RAM for memckpt with a replica: skipped")
            if "ray-train" not in only:
                pass
            elif _fits(int(2.2 * size) + 3 * _GIB):
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
    for label, size in sizes:
        rows += stall_rows(label, raw[label], steps, raytrain_poll_s)
    return rows


def stall_rows(label: str, raw: dict[str, Any], steps: int,
               raytrain_poll_s: Optional[float]) -> list[dict[str, Any]]:
    methods, state_bytes = raw["methods"], raw["state_bytes"]
    rows = []
    for m in sorted(methods, key=lambda m: (STALL_METHODS.index(base_method(m)), m)):
        r = methods[m]
        row: dict[str, Any] = {
            "benchmark": "stall", "method": m, "size": label, "state_bytes": state_bytes,
            "harness": raw["harness"].get(m, "process"), "steps": len(r["step_s"]),
            "step_s": _med(r["step_s"]), "blocking_s": _med(r["blocking_s"]),
            "compute_s": _med(r["compute_s"]),
            "samples": {k: r[k] for k in ("step_s", "blocking_s", "compute_s")},
        }
        for k in ("persist_s", "write_s", "report_s"):
            if r.get(k):
                row[k] = _med(r[k])
        if "replicate_s" in r:
            row["replicate_s"] = r["replicate_s"]
        if "store_bytes" in r:
            row["store_bytes"] = r["store_bytes"]
        if m.startswith("ray-train"):
            row["raytrain_poll_s"] = raytrain_poll_s if raytrain_poll_s is not None else 2.0
        rows.append(row)
    return rows


def derive_stall(rows: list[dict[str, Any]]) -> None:
    """Fill stall, ratios and fractions of the limit into the stall rows (in place)."""
    by = {(r["size"], r["method"]): r for r in rows if r["benchmark"] == "stall"}
    for (size, m), r in by.items():
        if is_baseline(m):
            r["median"] = r["step_s"]
            r["figure"] = "step time (baseline)"
            r["stall_s"] = 0.0
        elif m in LIMITS:
            r["median"] = r["stall_s"] = r["blocking_s"]
            r["figure"] = "copy time (limit)" if m == "memcpy" else "write + fsync time (limit)"
        else:
            base = by.get((size, harness_base(m)))
            increase = r["step_s"] - base["step_s"] if base else None
            # what the call blocks beyond the same call without a checkpoint (Ray Train's
            # report(metrics) alone waits for the controller's poll too)
            own = r["blocking_s"] - (base["blocking_s"] if base else 0.0)
            r["step_increase_s"] = increase
            r["own_blocking_s"] = own
            r["base_step_s"] = base["step_s"] if base else None
            r["median"] = r["stall_s"] = max(increase if increase is not None else 0.0, own,
                                             r.get("write_s") or 0.0)
            r["figure"] = "stall = max(step-time increase, blocking part beyond the baseline's)"
        r["unit"] = "s"
        r["median_s"] = r["median"]
    for (size, m), r in by.items():
        memcpy, disk = by.get((size, "memcpy")), by.get((size, "raw-disk-write"))
        ref = by.get((size, "memckpt")) or by.get((size, "memckpt-local"))
        if is_baseline(m):
            continue
        r["x_memcpy"] = r["stall_s"] / memcpy["stall_s"] if memcpy else None
        r["x_memckpt"] = r["stall_s"] / ref["stall_s"] if ref and m not in LIMITS else None
        if m.startswith("memckpt"):
            r["fraction_of_limit"] = memcpy["stall_s"] / r["stall_s"] if memcpy else None
        if disk and base_method(m) in ("torch.save", "dcp-async", "ray-train"):
            r["x_disk_write"] = r["stall_s"] / disk["stall_s"]


# -- lost work ------------------------------------------------------------------------------------
def lost_work_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per checkpointing method and size: the interval it can afford at <= 5% overhead and the
    expected recomputed steps per failure (N/2 + steps until a checkpoint is recoverable)."""
    out = []
    for r in rows:
        if r["benchmark"] != "stall" or base_method(r["method"]) not in CHECKPOINT_METHODS:
            continue
        base = r.get("base_step_s")
        if not base:
            continue
        cost = r["stall_s"]  # per checkpoint, measured with one checkpoint every step
        interval = max(1, math.ceil(cost / (OVERHEAD_BUDGET * base)))
        # a checkpoint is recoverable once it is replicated / written in the background
        lag_s = {"memckpt": r.get("replicate_s"), "dcp-async": r.get("persist_s")}.get(r["method"]) or 0.0
        lag_steps = lag_s / (base + cost / interval)
        lost = interval / 2 + lag_steps
        out.append({
            "benchmark": "lost_work", "method": r["method"], "size": r["size"],
            "state_bytes": r["state_bytes"], "median": lost, "unit": "steps",
            "figure": "expected recomputed steps per failure",
            "interval_steps": interval, "cost_per_checkpoint_s": cost, "base_step_s": base,
            "overhead_every_step": cost / base, "overhead_at_interval": cost / (interval * base),
            "recoverable_lag_s": lag_s, "lag_steps": lag_steps,
            "lost_time_s": lost * base,
            "note": f"cost = stall at one checkpoint per step; interval = ceil(cost / "
                    f"({OVERHEAD_BUDGET:.0%} x step)); lost = interval / 2 + lag",
        })
    return out


# -- recovery -------------------------------------------------------------------------------------
def measure_recovery(sizes: list[tuple[str, int]], repeats: int, directory: Path,
                     raytrain_poll_s: Optional[float], compute_iters: int, kill_at: int,
                     log: Callable[[str], None]) -> list[dict[str, Any]]:
    from memckpt.bench import alternatives as alt
    from memckpt.bench import recovery as rec
    from memckpt.bench.recovery_job import DEFAULT_LAYERS
    from memckpt.runtime.local_cluster import LocalCluster
    biggest = max(s for _, s in sizes)
    store_mb = max(256, int(1.25 * biggest / 2**20) + 128)
    log(f"recovery: starting a local {rec.NODES}-node cluster (object store {store_mb} MiB per node)")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    cluster = LocalCluster(nodes=rec.NODES, cpus_per_node=rec.CPUS_PER_NODE, object_store_mb=store_mb)
    disk = Path(tempfile.mkdtemp(prefix="memckpt-compare-recovery-", dir=directory))
    ram_root = rec._ram_dir()
    run_root = Path(tempfile.mkdtemp(prefix="memckpt-compare-recovery-runs-"))
    rows: list[dict[str, Any]] = []
    try:
        _connect(cluster)
        for label, size in sizes:
            # 2 ranks x (live state + 2 own slots + 2 replica slots) + a peer fetch's copy;
            # recovery.memory_needed adds a removed node's files, which are freed here at once
            need = 11 * size + 4 * _GIB
            if not _fits(need):
                log(f"recovery {label}: needs ~{need / _GIB:.0f} GiB free: skipped")
                continue
            b = rec._Bench(cluster, size, DEFAULT_LAYERS, kill_at, 2, compute_iters, disk,
                           ram_root, run_root, log)
            b._restore_nodes()
            samples: dict[str, list[dict[str, Any]]] = {m: [] for m in RECOVERY_METHODS}
            raw: list[dict[str, Any]] = []
            for rep in range(repeats):
                log(f"recovery {label}: repeat {rep + 1}/{repeats}")
                samples["memckpt-worker"].append(b.memckpt_recovery("worker", rep))
                try:
                    s = b.memckpt_recovery("node", rep)
                    samples["memckpt-node"].append(s)
                    if "peer_fetch" in s:
                        pf = s["peer_fetch"]
                        raw.append(b.raw_transfer(pf["src"], pf["dst"], pf["bytes"]))
                finally:
                    b._restore_nodes()
                samples["restart+torch.load"].append(b.restart_baseline(rep))
                try:  # memckpt-node's failure, for the alternative
                    samples[BASELINE_NODE].append(
                        b.restart_baseline(rep, rec.ColdWorker, node_loss=True))
                finally:
                    b._restore_nodes()
                samples["restart+dcp.load"].append(alt.dcp_recovery(b, rep))
                log(f"restart+dcp.load: total {samples['restart+dcp.load'][-1]['total_s']:.2f} s")
                with alt.raytrain_poll(raytrain_poll_s):
                    s = alt.raytrain_recovery(b.d, b.n, kill_at, compute_iters, disk, disk,
                                              f"cmp-rt-rec-{label.lower()}-{rep}-{os.getpid()}",
                                              rec.CPUS_PER_NODE)
                samples["ray-train-restore"].append(s)
                log(f"ray-train-restore: total {s['total_s']:.2f} s ({s['phases_s']})")
            rows += recovery_rows(label, b.state_bytes, samples, raw, raytrain_poll_s)
    finally:
        cluster.shutdown()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(ram_root, ignore_errors=True)
        shutil.rmtree(run_root, ignore_errors=True)
    return rows


def recovery_rows(label: str, state_bytes: int, samples: dict[str, list[dict[str, Any]]],
                  raw: list[dict[str, Any]], raytrain_poll_s: Optional[float]) -> list[dict[str, Any]]:
    notes = {
        "memckpt-worker": "rank 1 SIGKILLed; restored from its node's RAM (local store)",
        "memckpt-node": "rank 1's node removed; restored on the spare node from the peer store",
        "restart+torch.load": "every worker restarted (cold Ray actors), torch.load from local "
                              "disk (page cache dropped)",
        "restart+dcp.load": "every worker restarted (cold Ray actors), dcp.load + set_state_dict "
                            "from local disk (page cache dropped)",
        "ray-train-restore": "TorchTrainer, FailureConfig(max_failures=1): Ray Train restarts the "
                             "worker group, get_checkpoint() from storage_path, torch.load",
        BASELINE_NODE: "rank 1's node removed (memckpt-node's failure); every worker "
                           "restarted, rank 1 on the third node, torch.load from local disk",
    }
    rows = []
    for m in RECOVERY_METHODS:
        ss = samples.get(m) or []
        if not ss:
            continue
        phases: dict[str, Any] = {}
        for k in dict.fromkeys(k for s in ss for k in s["phases_s"]):
            vals = [s["phases_s"][k] for s in ss if isinstance(s["phases_s"].get(k), (int, float))]
            if vals:
                phases[k] = _med(vals)
        row = {"benchmark": "recovery", "method": m, "size": label, "state_bytes": state_bytes,
               "median": _med([s["total_s"] for s in ss]), "unit": "s",
               "figure": "fault -> first resumed step (every rank)",
               "samples_s": [s["total_s"] for s in ss], "phases_s": phases, "note": notes[m],
               "ranks": 2}
        if m.startswith("memckpt"):
            row["resume_split_s"] = {k: _med([s["resume_split_s"][k] for s in ss])
                                     for k in ss[0]["resume_split_s"]}
            row["sources"] = [s["sources"] for s in ss]
        if m == "memckpt-node" and raw:
            fetch = _med([s["peer_fetch"]["seconds"] for s in ss if "peer_fetch" in s])
            row["peer_fetch_s"] = fetch
            row["raw_transfer_s"] = _med([r["total_s"] for r in raw])
        if m == "ray-train-restore":
            row["raytrain_poll_s"] = raytrain_poll_s if raytrain_poll_s is not None else 2.0
        row["median_s"] = row["median"]
        rows.append(row)
    return rows


def derive_recovery(rows: list[dict[str, Any]]) -> None:
    by = {(r["size"], r["method"]): r for r in rows if r["benchmark"] == "recovery"}
    for (size, m), r in by.items():
        alts = [by[(size, a)]["median"] for a in ALTERNATIVES if (size, a) in by]
        ref = by.get((size, "memckpt-worker"))
        r["x_memckpt"] = r["median"] / ref["median"] if ref else None
        if m.startswith("memckpt") and alts:
            r["speedup_vs_fastest_alternative"] = min(alts) / r["median"]
        same = by.get((size, BASELINE_NODE))
        if m == "memckpt-node" and same:
            r["speedup_vs_same_failure"] = same["median"] / r["median"]
        if m == "memckpt-node" and r.get("raw_transfer_s") and r.get("peer_fetch_s"):
            r["fraction_of_limit"] = r["raw_transfer_s"] / r["peer_fetch_s"]


# -- scaling --------------------------------------------------------------------------------------
def measure_scaling(size: int, label: str, node_counts: list[int], steps: int, warmup: int,
                    compute_n: int, ram_root: str, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from memckpt.bench import alternatives as alt
    from memckpt.runtime.local_cluster import LocalCluster
    log(f"scaling: starting a local {max(node_counts)}-node cluster")
    cluster = LocalCluster(nodes=max(node_counts), cpus_per_node=2, object_store_mb=512)
    run_dir = Path(tempfile.mkdtemp(prefix="memckpt-compare-runs-"))
    rows: list[dict[str, Any]] = []
    try:
        _connect(cluster)
        for nodes in sorted(node_counts):
            base = None
            for k in (0, 1, 2):
                if k >= nodes:
                    continue
                if not _fits(int((2 + 2 * k + 1.3) * size * nodes) + 3 * _GIB):
                    log(f"scaling: {nodes} nodes, k={k}: not enough free RAM: skipped")
                    continue
                name = f"cmp-scale-{nodes}-{k}-{os.getpid()}"
                log(f"scaling: {nodes} nodes, k={k}" if k else f"scaling: {nodes} nodes, no snapshots")
                r = alt.memckpt_stall(size, steps, warmup, compute_n, snapshots=k > 0, workers=nodes,
                                      replicas=max(1, k), ram_root=ram_root, run_dir=run_dir,
                                      name=name, cpus_per_worker=2, full_ranks=nodes, threads=1)
                # with every rank training, the slowest rank sets the pace
                step = _med([max(v) for v in zip(*(p["step_s"] for p in r["per_rank"]))])
                blocking = _med([max(v) for v in zip(*(p["blocking_s"] for p in r["per_rank"]))])
                if k == 0:
                    base = step
                    rows.append({"benchmark": "scaling", "method": "memckpt-none", "nodes": nodes,
                                 "k": 0, "size": label, "state_bytes": r["state_bytes"],
                                 "median": step, "median_s": step, "unit": "s",
                                 "figure": "step time (baseline)", "step_s": step})
                    continue
                held = r.get("store_bytes") or {}
                stall = max(step - base, blocking) if base is not None else blocking
                rows.append({"benchmark": "scaling", "method": f"memckpt-k{k}", "nodes": nodes,
                             "k": k, "size": label, "state_bytes": r["state_bytes"],
                             "median": stall, "median_s": stall, "unit": "s",
                             "figure": "stall = max(step-time increase, blocking part)",
                             "step_s": step, "blocking_s": blocking, "base_step_s": base,
                             "store_bytes": held})
                if held:
                    per_node = max(held.values())
                    rows.append({"benchmark": "scaling", "method": f"memckpt-k{k}-memory",
                                 "nodes": nodes, "k": k, "size": label,
                                 "state_bytes": r["state_bytes"], "median": per_node,
                                 "unit": "bytes", "figure": "bytes held by a node's store (max)",
                                 "store_bytes": held,
                                 "x_state": per_node / r["state_bytes"],
                                 "expected_x_state": 2 + 2 * k,
                                 "note": "own 2 slots + 2 slots per replica held for k peers"})
    finally:
        cluster.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)
    return rows


# -- all of it ------------------------------------------------------------------------------------
def derive(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ratios, limits and lost work from the measured rows (drops earlier derived rows)."""
    rows = [r for r in rows if r["benchmark"] != "lost_work"]
    derive_stall(rows)
    derive_recovery(rows)
    return rows + lost_work_rows(rows)


def run_compare(parts: tuple[str, ...] = PARTS, sizes: Optional[list[tuple[str, int]]] = None,
                steps: int = 5, warmup: int = 2, step_s: float = DEFAULT_STEP_S,
                directory: Optional[str] = None, ram_root: Optional[str] = None,
                recovery_sizes: Optional[list[tuple[str, int]]] = None, recovery_repeats: int = 1,
                recovery_compute_iters: int = 40, kill_at: int = 4,
                nodes: tuple[int, ...] = (2, 3, 4), scaling_size: Optional[tuple[str, int]] = None,
                scaling_steps: Optional[int] = None, methods: tuple[str, ...] = SELECTABLE,
                raytrain_poll_s: Optional[float] = None,
                log: Callable[[str], None] = _log) -> list[dict[str, Any]]:
    from memckpt.bench.recovery import _disk_dir
    sizes = sizes or parse_sizes(DEFAULT_SIZES)
    recovery_sizes = recovery_sizes or [sizes[-1]]
    scaling_size = scaling_size or sizes[0]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    disk, _ = _disk_dir(directory)
    ram = Path(ram_root) if ram_root else Path(tempfile.mkdtemp(
        prefix="memckpt-compare-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    ram.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    try:
        compute_n, compute_alone = 0, 0.0
        if "stall" in parts or "scaling" in parts:
            calibrate_compute(step_s, Quiet())  # the first calibration runs cold: redo it
            _, compute_n, compute_alone = calibrate_compute(step_s, Quiet())
            log(f"simulated forward+backward: {compute_n} matmuls 256x256 = {compute_alone:.3f} s")
        if "stall" in parts:
            rows += measure_stall(sizes, steps, warmup, compute_n, disk, str(ram), raytrain_poll_s,
                                  log, methods)
        if "recovery" in parts:
            rows += measure_recovery(recovery_sizes, recovery_repeats, disk, raytrain_poll_s,
                                     recovery_compute_iters, kill_at, log)
        if "scaling" in parts:
            rows += measure_scaling(scaling_size[1], scaling_size[0], list(nodes), scaling_steps or steps,
                                    warmup, compute_n, str(ram), log)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        if not ram_root:
            shutil.rmtree(ram, ignore_errors=True)
    info = machine_info()
    for r in rows:
        r["machine"] = info
        r["compute_matmuls"] = compute_n
        r["compute_alone_s"] = compute_alone
    log(f"measured in {time.time() - t0:.0f} s")
    return derive(rows)


# -- report ---------------------------------------------------------------------------------------
def _fmt(r: dict[str, Any]) -> str:
    if r["unit"] == "s":
        return human_s(r["median"])
    if r["unit"] == "bytes":
        return human_bytes(r["median"])
    return f"{r['median']:.2f} steps"


def _x(v: Optional[float]) -> str:
    return "–" if v is None else (f"{v:.2f}" if v < 100 else f"{v:.0f}")


def _detail(r: dict[str, Any]) -> str:
    b, m = r["benchmark"], r["method"]
    if b == "stall":
        if is_baseline(m):
            return f"{r['harness']}, no checkpoint"
        parts = [f"blocking {human_s(r['blocking_s'])}"]
        if r.get("step_increase_s") is not None:
            parts.append(f"step +{human_s(max(0.0, r['step_increase_s']))}")
        if r.get("fraction_of_limit"):
            parts.append(f"{100 * r['fraction_of_limit']:.0f}% of memcpy speed")
        if r.get("replicate_s"):
            parts.append(f"replication {human_s(r['replicate_s'])} behind")
        if r.get("persist_s"):
            parts.append(f"write done {human_s(r['persist_s'])} after the call")
        if r.get("report_s") is not None and base_method(m) == "ray-train":
            parts.append(f"torch.save {human_s(r['write_s'])} + report {human_s(r['report_s'])}")
        return "; ".join(parts)
    if b == "lost_work":
        return (f"every {r['interval_steps']} steps ({100 * r['overhead_at_interval']:.1f}% "
                f"overhead; {100 * r['overhead_every_step']:.0f}% every step)")
    if b == "recovery":
        s = r["phases_s"]
        keys = [k for k in ("detect", "restart", "start_actors", "resume", "torch_load", "first_step")
                if k in s]
        out = ", ".join(f"{k} {s[k]:.2f}" for k in keys)
        if r.get("speedup_vs_fastest_alternative"):
            out += f"; {r['speedup_vs_fastest_alternative']:.2f}× faster than the fastest alternative"
        if r.get("speedup_vs_same_failure"):
            out += (f" (after a killed worker), {r['speedup_vs_same_failure']:.2f}× faster than "
                    "restart+torch.load after the same node loss")
        if r.get("fraction_of_limit"):
            out += f"; peer fetch at {100 * r['fraction_of_limit']:.0f}% of a raw TCP transfer"
        return out
    if b == "scaling":
        if m.endswith("memory"):
            return f"{r['x_state']:.2f}× the shard (expected {r['expected_x_state']})"
        if r.get("base_step_s"):
            return (f"{r['nodes']} nodes, k={r['k']}: +{100 * r['median'] / r['base_step_s']:.0f}% "
                    f"on a {human_s(r['base_step_s'])} step")
        return f"{r['nodes']} nodes, k={r['k']}, every rank training on the same 2 cores"
    return ""


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| benchmark | method | state | median | × memcpy | × memckpt | details |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    order = {p: i for i, p in enumerate(PARTS)}
    for r in sorted(rows, key=lambda r: (order[r["benchmark"]], r["state_bytes"] if r["benchmark"] != "scaling" else 0,
                                         r.get("nodes", 0))):
        name = r["method"] + (f" ({r['nodes']} nodes)" if r["benchmark"] == "scaling" else "")
        lines.append(f"| {r['benchmark']} | {name} | {human_bytes(r['state_bytes'])} | {_fmt(r)} | "
                     f"{_x(r.get('x_memcpy'))} | {_x(r.get('x_memckpt'))} | {_detail(r)} |")
    return "\n".join(lines)


def check_targets(rows: list[dict[str, Any]]) -> list[tuple[bool, str]]:
    checks: list[tuple[bool, str]] = []
    st = {(r["size"], r["method"]): r for r in rows if r["benchmark"] == "stall"}
    for (size, m), r in st.items():
        if m in ("memckpt", "memckpt-local") and r.get("x_memcpy"):
            memcpy = st[(size, "memcpy")]["stall_s"]
            checks.append((r["x_memcpy"] <= TARGET_X_MEMCPY,
                           f"{size}: {m} stall {r['x_memcpy']:.2f}× memcpy (target ≤ {TARGET_X_MEMCPY})"))
            checks.append((r["blocking_s"] / memcpy <= TARGET_X_MEMCPY,
                           f"{size}: {m} blocking part alone {r['blocking_s'] / memcpy:.2f}× memcpy"))
    for (size, m), r in st.items():
        if m not in ("memckpt", "memckpt-local") or r["state_bytes"] < _GIB // 2:
            continue
        for what, mine in (("stall", r["stall_s"]), ("blocking part", r["blocking_s"])):
            if (size, "torch.save") in st:
                x = st[(size, "torch.save")]["stall_s"] / mine
                checks.append((x >= TARGET_VS_TORCH_SAVE,
                               f"{size}: torch.save stall / {m} {what} = {x:.1f}× (target ≥ 10)"))
            if (size, "dcp-async") in st:
                x = st[(size, "dcp-async")]["blocking_s"]
                checks.append((mine < x, f"{size}: {m} {what} {human_s(mine)} vs DCP async_save "
                                         f"blocking part {human_s(x)} (target: lower)"))
    for r in rows:
        if r["benchmark"] == "recovery" and r["method"] == "memckpt-worker" and \
                r.get("speedup_vs_fastest_alternative"):
            for m in ("memckpt-worker", "memckpt-node"):
                rr = next((x for x in rows if x["benchmark"] == "recovery" and x["method"] == m
                           and x["size"] == r["size"]), None)
                if rr and rr.get("speedup_vs_same_failure"):  # a lost node's alternative
                    s = rr["speedup_vs_same_failure"]
                    checks.append((s >= TARGET_RECOVERY_SPEEDUP,
                                   f"{r['size']}: {m} recovery {s:.2f}× faster than "
                                   f"{BASELINE_NODE} (the same failure; target ≥ 3)"))
                elif rr and rr.get("speedup_vs_fastest_alternative"):
                    s = rr["speedup_vs_fastest_alternative"]
                    checks.append((s >= TARGET_RECOVERY_SPEEDUP,
                                   f"{r['size']}: {m} recovery {s:.2f}× faster than the fastest "
                                   f"alternative (target ≥ 3)"))
        if r["benchmark"] == "lost_work" and r["method"] == "memckpt":
            checks.append((r["median"] <= TARGET_LOST_STEPS and r["overhead_at_interval"] <= OVERHEAD_BUDGET,
                           f"{r['size']}: memckpt loses {r['median']:.2f} steps per failure at "
                           f"{100 * r['overhead_at_interval']:.1f}% overhead (target ≤ 1 at ≤ 5%)"))
    return checks


def report(rows: list[dict[str, Any]]) -> str:
    step = max(rows, key=lambda r: r.get("compute_alone_s") or 0, default=None)
    if step is None:
        return "no rows"
    head = machine_line(rows[0]["machine"],
                        f"simulated step {step.get('compute_alone_s') or 0:.2f} s "
                        f"({step.get('compute_matmuls') or 0} matmuls)")
    # no CPU-share warning: the compare rows do not record what other processes took
    return finish_report([head, "", format_table(rows)], rows, None,
                         lambda r: f"{r['benchmark']} {r['method']}", check_targets(rows),
                         missed="NOT met")


# -- command line ---------------------------------------------------------------------------------
def _parts(text: str) -> tuple[str, ...]:
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in out if p not in PARTS]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"invalid parts {text!r}: choose from {','.join(PARTS)}")
    return out


def _methods(text: str) -> tuple[str, ...]:
    out = tuple(p.strip() for p in text.split(",") if p.strip())
    bad = [p for p in out if p not in SELECTABLE]
    if not out or bad:
        raise argparse.ArgumentTypeError(f"invalid methods {text!r}: choose from {','.join(SELECTABLE)}")
    return out


def _node_counts(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(p) for p in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"invalid node counts {text!r}: e.g. 2,3,4 (each >= 2)")
    return out


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: seconds > 0")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", type=_parts, default=PARTS, metavar="LIST",
                        help=f"what to measure, comma-separated (default {','.join(PARTS)})")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        metavar="LIST", help=f"stall: state sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--methods", type=_methods, default=SELECTABLE, metavar="LIST",
                        help=f"stall: methods to measure (default all: {','.join(SELECTABLE)}; "
                             "each comes with its harness's no-checkpoint baseline)")
    parser.add_argument("--steps", type=positive_int, default=5, metavar="N",
                        help="stall: timed steps per method, after 2 warm-up steps (default 5)")
    parser.add_argument("--step-s", type=_seconds, default=DEFAULT_STEP_S, metavar="S",
                        help=f"simulated forward+backward per step (default {DEFAULT_STEP_S})")
    parser.add_argument("--recovery-sizes", type=parse_sizes, default=None, metavar="LIST",
                        help="recovery: state per rank (default: the largest of --sizes)")
    parser.add_argument("--recovery-repeats", type=positive_int, default=1, metavar="N")
    parser.add_argument("--nodes", type=_node_counts, default=(2, 3, 4), metavar="LIST",
                        help="scaling: simulated node counts, each >= 2 (default 2,3,4; k=2 from 3)")
    parser.add_argument("--scaling-size", type=parse_sizes, default=None, metavar="SIZE",
                        help="scaling: state per rank (default: the smallest of --sizes)")
    parser.add_argument("--raytrain-poll-s", type=_seconds, default=None, metavar="S",
                        help="Ray Train controller poll interval (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S; "
                             "default: Ray's, 2 s)")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="local-disk directory for the files (default: a temp dir on disk)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows to PATH")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the plot to PNG")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                        help="measure nothing: merge the rows of earlier --json files")


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.compare``, ``benchmarks/bench_compare.py``."""
    return standalone("memckpt bench compare", __doc__, add_arguments, main, argv)


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        rows = []
        for p in args.from_json:
            rows += json.loads(Path(p).read_text())
        rows = derive(rows)
    else:
        try:
            rows = run_compare(args.parts, args.sizes, args.steps, 2, args.step_s, args.dir,
                               recovery_sizes=args.recovery_sizes,
                               recovery_repeats=args.recovery_repeats, nodes=args.nodes,
                               scaling_size=args.scaling_size[0] if args.scaling_size else None,
                               raytrain_poll_s=args.raytrain_poll_s, methods=args.methods)
        except Exception as e:  # noqa: BLE001 (a failed measurement is reported, exit 1)
            print(f"memckpt bench compare: measurement failed: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return 1
    write_rows(args.json, rows, indent=1)
    if args.plot:
        from memckpt.bench.plot import plot_compare
        plot_compare(rows, args.plot)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
