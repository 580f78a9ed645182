"""The rows of ``memckpt bench recovery``: medians of the samples
:mod:`memckpt.bench.recovery.measure` took, each against what it is compared with."""

from __future__ import annotations

from statistics import median
from typing import Any, Optional

from memckpt.bench.common import med
from memckpt.bench.recovery.measure import PATH_ROUNDS, PATH_STEADY_FROM, RecoveryBench

# The alternative, after the two failures memckpt recovers from (a killed worker, a lost node).
# The alternative, after the two failures memckpt recovers from (a killed worker, a lost node).
BASELINE = "restart+torch.load"

BASELINE_NODE = "restart+torch.load-node-lost"



def _max_foreign(samples: list[dict[str, Any]]) -> Optional[float]:
    vals = [s.get("foreign_cpu") for s in samples if s.get("foreign_cpu") is not None]
    return max(vals) if vals else None


def _med_dict(dicts: list[dict[str, Any]]) -> dict[str, Optional[float]]:
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    return {k: med([d.get(k) for d in dicts]) for k in keys}


def build_rows(b: RecoveryBench, worker: list, node: list, base: list, raw: list, raw2: list, on: list,
               local: list, off: list, gpt_size: str, persist: tuple = (),
               paths: tuple = (), standby: tuple = (),
               base_node: tuple = ()) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    base_total = med([s["total_s"] for s in base])
    node_base_total = med([s["total_s"] for s in base_node])

    def recovery_row(method: str, samples: list, note: str,
                     node_lost: bool = False) -> dict[str, Any]:
        """``speedup_vs_restart``: against the alternative recovering from the same failure
        (a lost node's when ``node_lost`` and that was measured, else a killed worker's)."""
        total = med([s["total_s"] for s in samples])
        phases = _med_dict([s["phases_s"] for s in samples])
        against = BASELINE_NODE if node_lost and node_base_total else BASELINE
        base_s = node_base_total if against == BASELINE_NODE else base_total
        return {
            "benchmark": "recovery", "method": method, "state_bytes": b.state_bytes,
            "median_s": total, "samples_s": [s["total_s"] for s in samples],
            "phases_s": phases, "resume_split_s": _med_dict([s["resume_split_s"] for s in samples]),
            "runtime_total_s": phases.get("total"),
            "baseline": against,
            "speedup_vs_restart": (base_s / total) if total and base_s else None,
            # the node rows against a killed worker's alternative too (what earlier versions
            # of this benchmark reported)
            "speedup_vs_worker_restart": (base_total / total) if total and base_total else None,
            "foreign_cpu": _max_foreign(samples),
            "resumed_steps": [s["resumed_step"] for s in samples],
            "workers": [s.get("workers") for s in samples],
            "sources": [s["sources"] for s in samples],
            "spare_slot_ranks": [s.get("spare_slot_ranks", []) for s in samples], "note": note,
        }

    rows.append(recovery_row("memckpt-worker", worker,
                             "rank 1 SIGKILLed; restore from its node's RAM (local store)"))
    rows.append(recovery_row("memckpt-node", node,
                             "rank 1's node removed; rank 1 restarts on the spare node and "
                             "restores from the peer holding its replica", node_lost=True))
    if standby:
        rows.append(recovery_row(
            "memckpt-node-standby", standby,
            "the same with placement.standby_nodes=1: the third node runs no rank and holds "
            "both ranks' replicas, so rank 1 restarts there and takes its replica files as "
            "its own slots (a local restore)", node_lost=True))
    for method, samples, note in (
            (BASELINE, base, "rank 1 SIGKILLed; every worker killed, new Ray actors (cold, "
                             "import torch), torch.load from local disk (page cache dropped) "
                             "+ load_state_dict, one step"),
            (BASELINE_NODE, base_node,
             "rank 1's node removed (the same failure as the memckpt node rows: Ray's health "
             "checks declare it dead); every worker killed, new Ray actors, rank 1 on the third "
             "node; torch.load from this machine's disk (on a real cluster rank 1's file died "
             "with its node) + load_state_dict, one step")):
        if not samples:
            continue
        rows.append({
            "benchmark": "recovery", "method": method, "state_bytes": b.state_bytes,
            "median_s": med([s["total_s"] for s in samples]),
            "samples_s": [s["total_s"] for s in samples],
            "phases_s": _med_dict([s["phases_s"] for s in samples]),
            "restart_s": med([s["restart_s"] for s in samples]),
            "file_bytes": samples[0]["file_bytes"], "speedup_vs_restart": 1.0,
            "foreign_cpu": _max_foreign(samples), "note": note,
        })
    raw_total = med([r["total_s"] for r in raw])
    raw_bytes = raw[0]["bytes"] if raw else None
    fetches = [s["peer_fetch"] for s in node if "peer_fetch" in s]
    if fetches:
        fb, fs = fetches[0]["bytes"], med([f["seconds"] for f in fetches])
        rows.append({
            "benchmark": "transfer", "method": "memckpt-peer-fetch", "state_bytes": fb,
            "median_s": fs, "phases_s": {"fetch": fs}, "throughput_Bps": fb / fs if fs else None,
            "ratio_to_raw": (raw_total / fs * fb / raw_bytes) if fs and raw_total and raw_bytes
            else None,
            "foreign_cpu": _max_foreign(node),
            "note": "the restoring worker's fetch from the holder's store: one TCP stream into "
                    "the rank's own new snapshot slot (allocating the slot is slot_alloc in "
                    "the node recovery's split; verifying it is counted in verify)",
        })
    repl = [x for s in worker + node for x in s["replication"]]
    raw2_total = med([r["total_s"] for r in raw2])
    raw2_bytes = raw2[0]["bytes"] if raw2 else None
    if repl:
        rb = max(x[0] for x in repl)
        rs = med([x[1] for x in repl if x[0] == rb])
        rows.append({
            "benchmark": "transfer", "method": "memckpt-replication", "state_bytes": rb,
            "median_s": rs, "phases_s": {"replicate": rs}, "samples": len(repl),
            "foreign_cpu": _max_foreign(worker + node),
            "throughput_Bps": rb / rs if rs else None,
            # both ranks replicate at once (each to the other's node): compare with two raw
            # transfers at once; the one-way figure is kept too
            "ratio_to_raw": (raw2_total / rs * rb / raw2_bytes) if rs and raw2_total and raw2_bytes
            else None,
            "ratio_to_raw_one_way": (raw_total / rs * rb / raw_bytes) if rs and raw_total and raw_bytes
            else None,
            "note": "workers' replicate_s for one shard to its holder (one TCP stream into the "
                    "holder's file, holder verifies before it acks); both ranks replicate at once, "
                    "so the raw figure is two raw TCP transfers at once",
        })
    rows += _path_rows(paths)
    for samples, method, note in (
            (raw, "raw-tcp", "one raw TCP transfer from the holder's node to the restoring "
                             "rank's node (sendall into recv_into a preallocated buffer)"),
            (raw2, "raw-tcp-2way", "two raw TCP transfers at once between the two training "
                                   "nodes, one each way (sendall into recv_into a preallocated "
                                   "buffer; per-transfer time)")):
        if samples:
            total, nbytes = med([r["total_s"] for r in samples]), samples[0]["bytes"]
            rows.append({
                "benchmark": "transfer", "method": method, "state_bytes": nbytes,
                "median_s": total, "throughput_Bps": nbytes / total if total else None,
                "foreign_cpu": _max_foreign(samples), "note": note,
            })
    step_off = med([x for s in off for x in s["intervals"]])
    gpt_bytes = on[0]["state_bytes"] if on else None
    job = "memckpt.demo.job.GPTJob, 2 ranks (DDP + ZeRO over gloo, 1 CPU each)"
    for runs, method, note in (
            (on, "snapshot-every-step", f"{job}, snapshot + replication every step; wall time "
                                        "between consecutive ctx.step calls"),
            (persist, "snapshot-every-step-persist-every-10",
             "the same, and every 10th committed step also written to local disk"),
            (local, "local-snapshot-only", "the same job, snapshot every step but "
                                           "placement.replicas=0: the local copy and seal alone"),
            (off, "no-snapshot", "the same job with snapshot_every larger than the step count")):
        if not runs:
            continue
        step = med([x for s in runs for x in s["intervals"]])
        inside = med([x for s in runs for x in s["inside"]])
        rows.append({
            "benchmark": "step-time", "method": f"gpt-{gpt_size}-{method}",
            "state_bytes": gpt_bytes, "median_s": step,
            "phases_s": {"step": step, "in_ctx_step": inside,
                         "outside": (step - inside) if step and inside is not None else None},
            "steps": sum(len(s["intervals"]) for s in runs),
            "waited_s_total": med([s["waited_s"] for s in runs]),  # per run, all snapshots
            "foreign_cpu": _max_foreign(runs),
            "slowdown": (step / step_off - 1) if step and step_off else None,
            # rank 0's replica bytes per run: sent over TCP, and filled by its holder from
            # the copy of the (identical, DDP) parameters on the holder's own node
            "replica_sent_bytes": med([s.get("sent_bytes", 0) for s in runs]),
            "replica_filled_bytes": med([s.get("filled_bytes", 0) for s in runs]),
            "note": note,
        })
    return rows


def _path_rows(paths: list) -> list[dict[str, Any]]:
    """The transfer-path rows: each path against raw TCP measured in the same call (both
    ways at once for replication, one way for a fetch). The ratio is the median over calls
    of each call's own ratio, so a raw transfer slowed by a passing load in one call does
    not set the figure for all of them."""
    if not paths:
        return []
    nbytes = paths[0]["bytes"]
    rows = []
    for method, key, raw_key, note in (
            ("memckpt-replication-path", "replicate_s", "raw_2way_s",
             "nothing else running: a shard streamed into a peer's ReplicaStore, both ways at "
             f"once, verified there before the ack; rounds {PATH_STEADY_FROM}-{PATH_ROUNDS} of "
             f"{PATH_ROUNDS} (both of a holder's slot files exist, as in a running job); vs "
             "two raw TCP transfers at once in the same call"),
            ("memckpt-fetch-path", "fetch_s", "raw_1way_s",
             "nothing else running: a shard fetched from a peer's store into a preallocated "
             "buffer (a restore verifies it afterwards); vs one raw TCP transfer in the same "
             "call")):
        vals = [t for p in paths for t in p[key]]
        raws = [t for p in paths for t in p[raw_key]]
        mid, raw = med(vals), med(raws)
        ratio = med([median(p[raw_key]) / median(p[key]) for p in paths])
        rows.append({
            "benchmark": "transfer", "method": method, "state_bytes": nbytes, "median_s": mid,
            "samples_s": vals, "raw_s": raws, "raw_median_s": raw,
            "phases_s": {"replicate" if key == "replicate_s" else "fetch": mid},
            "throughput_Bps": nbytes / mid if mid else None,
            "ratio_to_raw": ratio, "foreign_cpu": _max_foreign(paths), "note": note,
        })
    return rows

