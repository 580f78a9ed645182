"""The rows of ``memckpt bench recovery``: medians of the samples
:mod:`memckpt.bench.recovery.measure` took, each against what it is compared with."""

from __future__ import annotations

from dataclasses import dataclass, field
from statistics import median
from typing import Any, ClassVar, Mapping, Optional

from memckpt.bench.common import KindedRow, med
from memckpt.bench.recovery.measure import PATH_ROUNDS, PATH_STEADY_FROM, RecoveryBench

# The alternative, after the two failures memckpt recovers from (a killed worker, a lost node).
BASELINE = "restart+torch.load"
BASELINE_NODE = "restart+torch.load-node-lost"

Sample = dict[str, Any]  # one measurement, as RecoveryBench.measure returns it
Phases = dict[str, Optional[float]]


@dataclass
class Samples:
    """Every measurement of one run, by part; :func:`build_rows` turns them into rows."""

    worker: list[Sample] = field(default_factory=list)  # memckpt, a killed worker
    node: list[Sample] = field(default_factory=list)  # memckpt, a lost node
    standby: list[Sample] = field(default_factory=list)  # the same with a standby node
    base: list[Sample] = field(default_factory=list)  # BASELINE
    base_node: list[Sample] = field(default_factory=list)  # BASELINE_NODE
    raw: list[Sample] = field(default_factory=list)  # one raw TCP transfer
    raw2: list[Sample] = field(default_factory=list)  # two at once, one each way
    paths: list[Sample] = field(default_factory=list)  # replication / fetch path vs raw TCP
    on: list[Sample] = field(default_factory=list)  # step time: snapshot every step
    persist: list[Sample] = field(default_factory=list)  # ... and a disk tier every 10 steps
    local: list[Sample] = field(default_factory=list)  # ... the local copy alone
    off: list[Sample] = field(default_factory=list)  # ... no snapshot


# The keys each kind of row has, in the order the JSON output has always had them.
SHAPES: dict[str, tuple[str, ...]] = {
    "recovery": ("benchmark", "method", "state_bytes", "median_s", "samples_s", "phases_s",
                 "resume_split_s", "runtime_total_s", "baseline", "speedup_vs_restart",
                 "speedup_vs_worker_restart", "foreign_cpu", "resumed_steps", "workers",
                 "sources", "peak_footprint_x", "peak_footprint_bytes", "peak_footprint_parts",
                 "note"),
    "baseline": ("benchmark", "method", "state_bytes", "median_s", "samples_s", "phases_s",
                 "restart_s", "file_bytes", "speedup_vs_restart", "foreign_cpu", "note"),
    "peer-fetch": ("benchmark", "method", "state_bytes", "median_s", "phases_s",
                   "throughput_Bps", "ratio_to_raw", "foreign_cpu", "note"),
    "replication": ("benchmark", "method", "state_bytes", "median_s", "phases_s", "samples",
                    "foreign_cpu", "throughput_Bps", "ratio_to_raw", "ratio_to_raw_one_way",
                    "note"),
    "path": ("benchmark", "method", "state_bytes", "median_s", "samples_s", "raw_s",
             "raw_median_s", "phases_s", "throughput_Bps", "ratio_to_raw", "foreign_cpu",
             "note"),
    "raw": ("benchmark", "method", "state_bytes", "median_s", "throughput_Bps", "foreign_cpu",
            "note"),
    "step-time": ("benchmark", "method", "state_bytes", "median_s", "phases_s", "steps",
                  "waited_s_total", "foreign_cpu", "slowdown", "replica_sent_bytes",
                  "replica_filled_bytes", "note"),
}


@dataclass(frozen=True)
class Row(KindedRow):
    """One result row; ``shape`` (one of :data:`SHAPES`) says which fields it reports."""

    shape: str
    benchmark: str
    method: str
    state_bytes: Optional[int]
    median_s: Optional[float]
    note: str
    foreign_cpu: Optional[float] = None  # the CPU share other processes took meanwhile
    samples_s: Optional[list[float]] = None
    phases_s: Optional[Phases] = None
    resume_split_s: Optional[Phases] = None
    runtime_total_s: Optional[float] = None
    baseline: Optional[str] = None
    speedup_vs_restart: Optional[float] = None  # against the alternative, the same failure
    # the node rows against a killed worker's alternative too (what earlier versions of this
    # benchmark reported)
    speedup_vs_worker_restart: Optional[float] = None
    resumed_steps: Optional[list[int]] = None
    workers: Optional[list[Any]] = None
    sources: Optional[list[dict[str, str]]] = None
    # memckpt's host RAM at its peak over a run (training, fault, recovery), the worst run:
    # against one copy of every rank's shard, in bytes, and where (path below the job's
    # RAM folder -> bytes)
    peak_footprint_x: Optional[float] = None
    peak_footprint_bytes: Optional[int] = None
    peak_footprint_parts: Optional[dict[str, int]] = None
    restart_s: Optional[float] = None
    file_bytes: Optional[int] = None
    throughput_Bps: Optional[float] = None
    ratio_to_raw: Optional[float] = None
    ratio_to_raw_one_way: Optional[float] = None
    samples: Optional[int] = None
    raw_s: Optional[list[float]] = None
    raw_median_s: Optional[float] = None
    steps: Optional[int] = None
    waited_s_total: Optional[float] = None  # per run, all snapshots
    slowdown: Optional[float] = None
    # rank 0's replica bytes per run: sent over TCP, and filled by its holder from the copy
    # of the (identical, DDP) parameters on the holder's own node
    replica_sent_bytes: Optional[float] = None
    replica_filled_bytes: Optional[float] = None
    KIND: ClassVar[str] = "shape"
    KEYS: ClassVar[Mapping[str, tuple[str, ...]]] = SHAPES


def _max_foreign(samples: list[Sample]) -> Optional[float]:
    vals = [s["foreign_cpu"] for s in samples if s.get("foreign_cpu") is not None]
    return max(vals) if vals else None


def _med_dict(dicts: list[dict[str, Any]]) -> Phases:
    keys = list(dict.fromkeys(k for d in dicts for k in d))
    return {k: med([d.get(k) for d in dicts]) for k in keys}


def build_rows(b: RecoveryBench, got: Samples, gpt_size: str) -> list[Row]:
    """The rows of one run, each against what it is compared with."""
    rows = [_recovery_row(b, got, "memckpt-worker", got.worker,
                          "rank 1 SIGKILLed; restore from its node's RAM (local store)"),
            _recovery_row(b, got, "memckpt-node", got.node,
                          "rank 1's node removed; rank 1 restarts on the spare node and "
                          "restores from the peer holding its replica", node_lost=True)]
    if got.standby:
        rows.append(_recovery_row(
            b, got, "memckpt-node-standby", got.standby,
            "the same with placement.standby_nodes=1: the third node runs no rank and holds "
            "both ranks' replicas, so rank 1 restarts there and takes its replica files as "
            "its own slots (a local restore)", node_lost=True))
    rows += _baseline_rows(b, got)
    rows += _transfer_rows(got)
    rows += _path_rows(got.paths)
    rows += _raw_rows(got)
    rows += _step_time_rows(got, gpt_size)
    return rows


def _totals(samples: list[Sample]) -> list[float]:
    return [s["total_s"] for s in samples]


def _recovery_row(b: RecoveryBench, got: Samples, method: str, samples: list[Sample], note: str,
                  node_lost: bool = False) -> Row:
    """``speedup_vs_restart``: against the alternative recovering from the same failure
    (a lost node's when ``node_lost`` and that was measured, else a killed worker's)."""
    base_total, node_base_total = med(_totals(got.base)), med(_totals(got.base_node))
    total = med(_totals(samples))
    phases = _med_dict([s["phases_s"] for s in samples])
    against = BASELINE_NODE if node_lost and node_base_total else BASELINE
    base_s = node_base_total if against == BASELINE_NODE else base_total
    return Row(
        "recovery", "recovery", method, b.state_bytes, total, note,
        foreign_cpu=_max_foreign(samples), samples_s=_totals(samples), phases_s=phases,
        resume_split_s=_med_dict([s["resume_split_s"] for s in samples]),
        runtime_total_s=phases.get("total"), baseline=against,
        speedup_vs_restart=(base_s / total) if total and base_s else None,
        speedup_vs_worker_restart=(base_total / total) if total and base_total else None,
        resumed_steps=[s["resumed_step"] for s in samples],
        workers=[s.get("workers") for s in samples], sources=[s["sources"] for s in samples],
        **_worst_footprint(samples))


def _worst_footprint(samples: list[Sample]) -> dict[str, Any]:
    """The run whose host-RAM peak was the largest against its state (a bound is checked
    against the worst, not the median)."""
    got = [s for s in samples if s.get("peak_footprint_x") is not None]
    if not got:
        return {}
    worst = max(got, key=lambda s: s["peak_footprint_x"])
    return {"peak_footprint_x": worst["peak_footprint_x"],
            "peak_footprint_bytes": worst["peak_footprint_bytes"],
            "peak_footprint_parts": worst.get("peak_footprint_parts")}


def _baseline_rows(b: RecoveryBench, got: Samples) -> list[Row]:
    rows = []
    for method, samples, note in (
            (BASELINE, got.base, "rank 1 SIGKILLed; every worker killed, new Ray actors (cold, "
                                 "import torch), torch.load from local disk (page cache "
                                 "dropped) + load_state_dict, one step"),
            (BASELINE_NODE, got.base_node,
             "rank 1's node removed (the same failure as the memckpt node rows: Ray's health "
             "checks declare it dead); every worker killed, new Ray actors, rank 1 on the third "
             "node; torch.load from this machine's disk (on a real cluster rank 1's file died "
             "with its node) + load_state_dict, one step")):
        if samples:
            rows.append(Row(
                "baseline", "recovery", method, b.state_bytes, med(_totals(samples)), note,
                foreign_cpu=_max_foreign(samples), samples_s=_totals(samples),
                phases_s=_med_dict([s["phases_s"] for s in samples]),
                restart_s=med([s["restart_s"] for s in samples]),
                file_bytes=samples[0]["file_bytes"], speedup_vs_restart=1.0))
    return rows


def _transfer_rows(got: Samples) -> list[Row]:
    """A peer fetch and replication, each against raw TCP of the same shape."""
    rows = []
    raw_total, raw_bytes = med(_totals(got.raw)), got.raw[0]["bytes"] if got.raw else None
    fetches = [s["peer_fetch"] for s in got.node if "peer_fetch" in s]
    if fetches:
        fb, fs = fetches[0]["bytes"], med([f["seconds"] for f in fetches])
        rows.append(Row(
            "peer-fetch", "transfer", "memckpt-peer-fetch", fb, fs,
            "the restoring worker's fetch from the holder's store: one TCP stream into the "
            "rank's own new snapshot slot (allocating the slot is slot_alloc in the node "
            "recovery's split; verifying it is counted in verify)",
            phases_s={"fetch": fs}, throughput_Bps=fb / fs if fs else None,
            ratio_to_raw=(raw_total / fs * fb / raw_bytes) if fs and raw_total and raw_bytes
            else None, foreign_cpu=_max_foreign(got.node)))
    repl = [x for s in got.worker + got.node for x in s["replication"]]
    raw2_total = med(_totals(got.raw2))
    raw2_bytes = got.raw2[0]["bytes"] if got.raw2 else None
    if repl:
        rb = max(x[0] for x in repl)
        rs = med([x[1] for x in repl if x[0] == rb])
        rows.append(Row(
            "replication", "transfer", "memckpt-replication", rb, rs,
            "workers' replicate_s for one shard to its holder (one TCP stream into the "
            "holder's file, holder verifies before it acks); both ranks replicate at once, "
            "so the raw figure is two raw TCP transfers at once",
            phases_s={"replicate": rs}, samples=len(repl),
            foreign_cpu=_max_foreign(got.worker + got.node),
            throughput_Bps=rb / rs if rs else None,
            # both ranks replicate at once (each to the other's node): compare with two raw
            # transfers at once; the one-way figure is kept too
            ratio_to_raw=(raw2_total / rs * rb / raw2_bytes) if rs and raw2_total and raw2_bytes
            else None,
            ratio_to_raw_one_way=(raw_total / rs * rb / raw_bytes)
            if rs and raw_total and raw_bytes else None))
    return rows


def _raw_rows(got: Samples) -> list[Row]:
    rows = []
    for samples, method, note in (
            (got.raw, "raw-tcp", "one raw TCP transfer from the holder's node to the restoring "
                                 "rank's node (sendall into recv_into a preallocated buffer)"),
            (got.raw2, "raw-tcp-2way", "two raw TCP transfers at once between the two training "
                                       "nodes, one each way (sendall into recv_into a "
                                       "preallocated buffer; per-transfer time)")):
        if samples:
            total, nbytes = med(_totals(samples)), samples[0]["bytes"]
            rows.append(Row("raw", "transfer", method, nbytes, total, note,
                            throughput_Bps=nbytes / total if total else None,
                            foreign_cpu=_max_foreign(samples)))
    return rows


def _step_time_rows(got: Samples, gpt_size: str) -> list[Row]:
    rows = []
    step_off = med([x for s in got.off for x in s["intervals"]])
    gpt_bytes = got.on[0]["state_bytes"] if got.on else None
    job = "memckpt.demo.job.GPTJob, 2 ranks (DDP + ZeRO over gloo, 1 CPU each)"
    for runs, method, note in (
            (got.on, "snapshot-every-step", f"{job}, snapshot + replication every step; wall "
                                            "time between consecutive ctx.step calls"),
            (got.persist, "snapshot-every-step-persist-every-10",
             "the same, and every 10th committed step also written to local disk"),
            (got.local, "local-snapshot-only", "the same job, snapshot every step but "
                                               "placement.replicas=0: the local copy and seal "
                                               "alone"),
            (got.off, "no-snapshot", "the same job with snapshot_every larger than the step "
                                     "count")):
        if not runs:
            continue
        step = med([x for s in runs for x in s["intervals"]])
        inside = med([x for s in runs for x in s["inside"]])
        rows.append(Row(
            "step-time", "step-time", f"gpt-{gpt_size}-{method}", gpt_bytes, step, note,
            phases_s={"step": step, "in_ctx_step": inside,
                      "outside": (step - inside) if step and inside is not None else None},
            steps=sum(len(s["intervals"]) for s in runs),
            waited_s_total=med([s["waited_s"] for s in runs]), foreign_cpu=_max_foreign(runs),
            slowdown=(step / step_off - 1) if step and step_off else None,
            replica_sent_bytes=med([s.get("sent_bytes", 0) for s in runs]),
            replica_filled_bytes=med([s.get("filled_bytes", 0) for s in runs])))
    return rows


def _path_rows(paths: list[Sample]) -> list[Row]:
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
        rows.append(Row(
            "path", "transfer", method, nbytes, mid, note, samples_s=vals, raw_s=raws,
            raw_median_s=raw, phases_s={"replicate" if key == "replicate_s" else "fetch": mid},
            throughput_Bps=nbytes / mid if mid else None, ratio_to_raw=ratio,
            foreign_cpu=_max_foreign(paths)))
    return rows
