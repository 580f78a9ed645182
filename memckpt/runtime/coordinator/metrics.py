"""memckpt's Ray metrics: defined here, recorded by the coordinator.

They go through ``ray.util.metrics``, so every node's metrics agent serves them to
Prometheus (``http://<node>:<metrics_export_port>/metrics``) and the Ray dashboard's
Grafana panels can plot them. Ray prefixes each name with ``ray_`` and a counter's
with a ``_total`` suffix: ``memckpt_replicated_bytes`` is scraped as
``ray_memckpt_replicated_bytes_total``. Every metric carries the ``job`` tag.

Per step they are recorded from the nodes' step summaries, aggregated over the ranks (one
series per job, not one per rank: at thousands of ranks a series per rank updated every
step is the metrics agent's load, not information).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from memckpt.runtime.coordinator.messages import EventFields

STALL_BUCKETS_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]

# name -> (kind, description, tag keys besides "job")
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "memckpt_snapshot_stall_seconds": (
        "histogram", "time a training step spent in its snapshot (the local copy), its "
        "slowest rank's", ()),
    "memckpt_step_stall_seconds": (
        "gauge", "the last complete step's snapshot stall over the ranks: min, median, max",
        ("stat",)),
    "memckpt_snapshots_landed": (
        "counter", "snapshots sealed (restorable) of those due, over the ranks", ()),
    "memckpt_snapshots_skipped": (
        "counter", "due snapshots skipped (the previous one still sealing or not yet "
        "committed), over the ranks", ()),
    "memckpt_replicated_bytes": (
        "counter", "snapshot bytes sent to peer replica stores, over the ranks", ()),
    "memckpt_replication_lag_steps": (
        "gauge", "newest step any rank reached minus the last committed step", ()),
    "memckpt_committed_step": ("gauge", "last step every rank's shard and replicas hold", ()),
    "memckpt_failures": (
        "counter", "failures detected, by what died: worker, node, hung, unreachable, peer, "
        "coordinator", ("target",)),
    "memckpt_ranks_starved": (
        "counter", "late ranks whose silence was their process waiting for a CPU (not "
        "declared hung), once per rank and generation", ()),
    "memckpt_recovery_phase_seconds": (
        "gauge", "duration of each phase of the last recovery (detect, stop, plan, resume, "
        "total)", ("phase",)),
}


def failure_target(what: str) -> str:
    """What a ``failure_detected`` event's text says died (a dead node shows up later,
    in the recovery plan's ``dead_nodes``)."""
    for marker, target in (("frozen or cut off", "node"), ("hung", "hung"),
                           ("unreachable", "unreachable"),
                           ("lost a peer", "peer"), ("worker died", "worker")):
        if marker in what:
            return target
    return "other"


class JobMetrics:
    """The metrics of one job, recorded from the coordinator's per-step reports and events."""

    def __init__(self, job: str) -> None:
        from ray.util import metrics as rm
        classes = {"counter": rm.Counter, "gauge": rm.Gauge}
        self._m: dict[str, Any] = {}
        for name, (kind, desc, tags) in METRICS.items():
            m: Any
            if kind == "histogram":
                m = rm.Histogram(name, desc, boundaries=STALL_BUCKETS_S, tag_keys=("job",) + tags)
            else:
                m = classes[kind](name, desc, tag_keys=("job",) + tags)
            m.set_default_tags({"job": job})
            self._m[name] = m
        self._pending_failure: Optional[str] = None

    def counted(self, totals: Mapping[str, float]) -> None:
        """Counter increases summed over some step summaries
        (:mod:`memckpt.policy.step_metrics`)."""
        for key, name in (("replicated_bytes", "memckpt_replicated_bytes"),
                          ("landed", "memckpt_snapshots_landed"),
                          ("skipped", "memckpt_snapshots_skipped")):
            delta = totals.get(key)
            if delta:
                self._m[name].inc(float(delta))

    def stalls(self, stats: Mapping[str, float]) -> None:
        """A complete step's stall over the ranks (min / median / max)."""
        self._m["memckpt_snapshot_stall_seconds"].observe(stats["max"])
        for stat, seconds in stats.items():
            self._m["memckpt_step_stall_seconds"].set(seconds, tags={"stat": stat})

    def progress(self, newest_step: int, committed: Optional[int]) -> None:
        self._m["memckpt_committed_step"].set(committed if committed is not None else -1)
        if newest_step >= 0:
            self._m["memckpt_replication_lag_steps"].set(newest_step - (committed or 0))

    def event(self, kind: str, fields: EventFields) -> None:
        """Failures and recovery timings, from the events the runtime logs. A failure is
        counted once its recovery plan shows whether a node died with it (or when the
        job fails before any plan)."""
        if kind == "failure_detected":
            self._count_pending()
            self._pending_failure = failure_target(str(fields.get("what", "")))
        elif kind == "recovery_plan" and self._pending_failure:
            dead_node = bool(fields.get("dead_nodes"))
            self._pending_failure = "node" if dead_node else self._pending_failure
            self._count_pending()
        elif kind == "job_failed":
            self._count_pending()
        elif kind == "rank_starved":
            self._m["memckpt_ranks_starved"].inc(1.0)
        elif kind == "coordinator_restarted":
            self._m["memckpt_failures"].inc(1.0, tags={"target": "coordinator"})
        elif kind == "recovery_finished":
            for phase, seconds in (fields.get("phases_s") or {}).items():
                if seconds is not None:
                    self._m["memckpt_recovery_phase_seconds"].set(seconds, tags={"phase": phase})

    def _count_pending(self) -> None:
        if self._pending_failure:
            self._m["memckpt_failures"].inc(1.0, tags={"target": self._pending_failure})
            self._pending_failure = None
