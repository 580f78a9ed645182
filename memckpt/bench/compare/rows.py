"""The rows of ``memckpt bench compare`` (see :mod:`memckpt.bench.compare`): what each method
is called and compared with, rows from the measured samples, and the figures derived from
them (stall, ratios, lost work, recovery speed-ups), again when rows of several runs merge."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

from memckpt.bench.common import KindedRow, med
from memckpt.bench.recovery.rows import BASELINE_NODE

PARTS = ("stall", "lost_work", "recovery", "scaling")
OVERHEAD_BUDGET = 0.05  # the interval a method can afford: cost <= 5% of the step time
STALL_METHODS = ("none", "memcpy", "raw-disk-write", "memckpt-local", "memckpt-none", "memckpt",
                 "torch.save", "dcp-async", "ray-train-none", "ray-train")
BASELINES = {"none", "memckpt-none", "ray-train-none"}
LIMITS = {"memcpy", "raw-disk-write"}
CHECKPOINT_METHODS = ("memckpt-local", "memckpt", "torch.save", "dcp-async", "ray-train")
RECOVERY_METHODS = ("memckpt-worker", "memckpt-node", "restart+torch.load", "restart+dcp.load",
                    "ray-train-restore", BASELINE_NODE)
ALTERNATIVES = ("restart+torch.load", "restart+dcp.load", "ray-train-restore")  # a killed worker


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


# The keys each shape of row has, in the order the JSON output has always had them; derive()
# adds the derived figures (ratios, stall, speed-ups) to the rows as dicts, after a merge too.
SHAPES: dict[str, tuple[str, ...]] = {
    "stall": ("benchmark", "method", "size", "state_bytes", "harness", "steps", "step_s",
              "blocking_s", "compute_s", "samples", "persist_s", "write_s", "report_s",
              "replicate_s", "store_bytes", "raytrain_poll_s"),
    "lost_work": ("benchmark", "method", "size", "state_bytes", "median", "unit", "figure",
                  "interval_steps", "cost_per_checkpoint_s", "base_step_s",
                  "overhead_every_step", "overhead_at_interval", "recoverable_lag_s",
                  "lag_steps", "lost_time_s", "note"),
    "recovery": ("benchmark", "method", "size", "state_bytes", "median", "unit", "figure",
                 "samples_s", "phases_s", "note", "ranks", "resume_split_s", "sources",
                 "peer_fetch_s", "raw_transfer_s", "raytrain_poll_s", "median_s"),
    "scaling-base": ("benchmark", "method", "nodes", "k", "size", "state_bytes", "median",
                     "median_s", "unit", "figure", "step_s"),
    "scaling": ("benchmark", "method", "nodes", "k", "size", "state_bytes", "median",
                "median_s", "unit", "figure", "step_s", "blocking_s", "base_step_s",
                "store_bytes"),
    "scaling-memory": ("benchmark", "method", "nodes", "k", "size", "state_bytes", "median",
                       "unit", "figure", "store_bytes", "x_state", "expected_x_state", "note"),
}


@dataclass(frozen=True)
class Row(KindedRow):
    """One measured row of ``memckpt bench compare``; ``shape`` names the keys it reports."""

    KIND: ClassVar[str] = "shape"
    KEYS: ClassVar[Mapping[str, tuple[str, ...]]] = SHAPES
    # measured only by some methods (a stall's persist or write time, replication, a
    # Ray Train poll; a memckpt recovery's split and sources, a peer fetch)
    OPTIONAL: ClassVar[frozenset[str]] = frozenset({
        "persist_s", "write_s", "report_s", "replicate_s", "store_bytes", "raytrain_poll_s",
        "resume_split_s", "sources", "peer_fetch_s", "raw_transfer_s"})

    shape: str
    benchmark: str  # one of PARTS
    method: str
    size: str  # the size's label, as given
    state_bytes: int
    median: Optional[float] = None  # the row's figure, in ``unit``
    median_s: Optional[float] = None
    unit: str = "s"
    figure: Optional[str] = None  # what ``median`` is
    note: Optional[str] = None
    # stall
    harness: Optional[str] = None  # process, memckpt.run or Ray Train
    steps: Optional[int] = None
    step_s: Optional[float] = None
    blocking_s: Optional[float] = None
    compute_s: Optional[float] = None
    samples: Optional[dict[str, list[float]]] = None
    persist_s: Optional[float] = None
    write_s: Optional[float] = None
    report_s: Optional[float] = None
    replicate_s: Optional[float] = None
    store_bytes: Optional[dict[str, int]] = None  # node id -> bytes its store holds
    raytrain_poll_s: Optional[float] = None
    # lost work
    interval_steps: Optional[int] = None
    cost_per_checkpoint_s: Optional[float] = None
    base_step_s: Optional[float] = None
    overhead_every_step: Optional[float] = None
    overhead_at_interval: Optional[float] = None
    recoverable_lag_s: Optional[float] = None
    lag_steps: Optional[float] = None
    lost_time_s: Optional[float] = None
    # recovery
    samples_s: Optional[list[float]] = None
    phases_s: Optional[dict[str, Any]] = None
    ranks: Optional[int] = None
    resume_split_s: Optional[dict[str, Optional[float]]] = None
    sources: Optional[list[Any]] = None
    peer_fetch_s: Optional[float] = None
    raw_transfer_s: Optional[float] = None
    # scaling
    nodes: Optional[int] = None
    k: Optional[int] = None
    x_state: Optional[float] = None
    expected_x_state: Optional[int] = None



# -- stall ----------------------------------------------------------------------------------------
def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    """``num / den``; None where either is missing or ``den`` is not positive: a stall is a
    difference of two noisy medians, and at a size where it is below the noise (a few MiB
    on a loaded machine) it comes out as 0, which no ratio can be taken against."""
    return num / den if num is not None and den is not None and den > 0 else None


def _med_if(r: dict[str, Any], key: str) -> Optional[float]:
    """The median of ``r[key]``, a figure only some methods measure; None without it."""
    return med(r[key]) if r.get(key) else None


def stall_rows(label: str, raw: dict[str, Any], steps: int,
               raytrain_poll_s: Optional[float]) -> list[dict[str, Any]]:
    methods, state_bytes = raw["methods"], raw["state_bytes"]
    rows = []
    for m in sorted(methods, key=lambda m: (STALL_METHODS.index(base_method(m)), m)):
        r = methods[m]
        rows.append(Row(
            "stall", "stall", m, label, state_bytes, harness=raw["harness"].get(m, "process"),
            steps=len(r["step_s"]), step_s=med(r["step_s"]), blocking_s=med(r["blocking_s"]),
            compute_s=med(r["compute_s"]),
            samples={k: r[k] for k in ("step_s", "blocking_s", "compute_s")},
            persist_s=_med_if(r, "persist_s"), write_s=_med_if(r, "write_s"),
            report_s=_med_if(r, "report_s"),
            replicate_s=r.get("replicate_s"), store_bytes=r.get("store_bytes"),
            raytrain_poll_s=(raytrain_poll_s if raytrain_poll_s is not None else 2.0)
            if m.startswith("ray-train") else None).to_dict())
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
            # never below 0: both differences can come out negative in the noise
            r["median"] = r["stall_s"] = max(increase if increase is not None else 0.0, own,
                                             r.get("write_s") or 0.0, 0.0)
            r["figure"] = "stall = max(step-time increase, blocking part beyond the baseline's)"
        r["unit"] = "s"
        r["median_s"] = r["median"]
    for (size, m), r in by.items():
        memcpy, disk = by.get((size, "memcpy")), by.get((size, "raw-disk-write"))
        ref = by.get((size, "memckpt")) or by.get((size, "memckpt-local"))
        if is_baseline(m):
            continue
        r["x_memcpy"] = ratio(r["stall_s"], memcpy["stall_s"]) if memcpy else None
        r["x_memckpt"] = ratio(r["stall_s"], ref["stall_s"]) if ref and m not in LIMITS else None
        if m.startswith("memckpt"):
            r["fraction_of_limit"] = ratio(memcpy["stall_s"], r["stall_s"]) if memcpy else None
        if disk and base_method(m) in ("torch.save", "dcp-async", "ray-train"):
            r["x_disk_write"] = ratio(r["stall_s"], disk["stall_s"])



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
        out.append(Row(
            "lost_work", "lost_work", r["method"], r["size"], r["state_bytes"], median=lost,
            unit="steps", figure="expected recomputed steps per failure",
            interval_steps=interval, cost_per_checkpoint_s=cost, base_step_s=base,
            overhead_every_step=cost / base, overhead_at_interval=cost / (interval * base),
            recoverable_lag_s=lag_s, lag_steps=lag_steps, lost_time_s=lost * base,
            note=f"cost = stall at one checkpoint per step; interval = ceil(cost / "
                 f"({OVERHEAD_BUDGET:.0%} x step)); lost = interval / 2 + lag").to_dict())
    return out



# -- recovery -------------------------------------------------------------------------------------
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
                phases[k] = med(vals)
        memckpt, fetched = m.startswith("memckpt"), m == "memckpt-node" and raw
        total = med([s["total_s"] for s in ss])
        rows.append(Row(
            "recovery", "recovery", m, label, state_bytes, median=total, median_s=total,
            figure="fault -> first resumed step (every rank)",
            samples_s=[s["total_s"] for s in ss], phases_s=phases, note=notes[m], ranks=2,
            resume_split_s={k: med([s["resume_split_s"][k] for s in ss])
                            for k in ss[0]["resume_split_s"]} if memckpt else None,
            sources=[s["sources"] for s in ss] if memckpt else None,
            peer_fetch_s=med([s["peer_fetch"]["seconds"] for s in ss if "peer_fetch" in s])
            if fetched else None,
            raw_transfer_s=med([r["total_s"] for r in raw]) if fetched else None,
            raytrain_poll_s=(raytrain_poll_s if raytrain_poll_s is not None else 2.0)
            if m == "ray-train-restore" else None).to_dict())
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
def _slowest(r: dict[str, Any], key: str) -> Optional[float]:
    """With every rank training, the slowest rank sets the pace: the median over steps of the
    slowest rank's ``key``."""
    return med([max(v) for v in zip(*(p[key] for p in r["per_rank"]))])


def scaling_rows(label: str, nodes: int, k: int, r: dict[str, Any],
                 base: Optional[float]) -> list[dict[str, Any]]:
    """The rows of one scaling run (``nodes`` ranks, ``k`` replicas; k = 0: the baseline);
    ``base``: the step time of the run with the same node count and no snapshots."""
    step, blocking = _slowest(r, "step_s"), _slowest(r, "blocking_s")
    if k == 0:
        return [Row("scaling-base", "scaling", "memckpt-none", label, r["state_bytes"],
                    median=step, median_s=step, figure="step time (baseline)", step_s=step,
                    nodes=nodes, k=0).to_dict()]
    held = r.get("store_bytes") or {}
    if base is None:
        stall = blocking
    else:  # every rank ran steps >= 1 steps (a positive int): both figures exist
        assert step is not None and blocking is not None
        stall = max(step - base, blocking)
    rows = [Row("scaling", "scaling", f"memckpt-k{k}", label, r["state_bytes"], median=stall,
                median_s=stall, figure="stall = max(step-time increase, blocking part)",
                step_s=step, blocking_s=blocking, base_step_s=base, store_bytes=held,
                nodes=nodes, k=k)]
    if held:
        per_node = max(held.values())
        rows.append(Row("scaling-memory", "scaling", f"memckpt-k{k}-memory", label,
                        r["state_bytes"], median=per_node, unit="bytes",
                        figure="bytes held by a node's store (max)", store_bytes=held,
                        x_state=per_node / r["state_bytes"], expected_x_state=2 + 2 * k,
                        note="own 2 slots + 2 slots per replica held for k peers", nodes=nodes,
                        k=k))
    return [row.to_dict() for row in rows]


# -- all of it ------------------------------------------------------------------------------------
def derive(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ratios, limits and lost work from the measured rows (drops earlier derived rows)."""
    rows = [r for r in rows if r["benchmark"] != "lost_work"]
    derive_stall(rows)
    derive_recovery(rows)
    return rows + lost_work_rows(rows)

