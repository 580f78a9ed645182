"""memckpt's Ray metrics: defined here, recorded by the coordinator.

They go through ``ray.util.metrics``, so every node's metrics agent serves them to
Prometheus (``http://<node>:<metrics_export_port>/metrics``) and the Ray dashboard's
Grafana panels can plot them. Ray prefixes each name with ``ray_`` and a counter's
with a ``_total`` suffix: ``memckpt_replicated_bytes`` is scraped as
``ray_memckpt_replicated_bytes_total``. Every metric carries the ``job`` tag.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

STALL_BUCKETS_S = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0]

# name -> (kind, description, tag keys besides "job")
METRICS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "memckpt_snapshot_stall_seconds": (
        "histogram", "time a training step spent in its snapshot (the local copy)", ("rank",)),
    "memckpt_snapshots_landed": (
        "counter", "snapshots sealed (restorable) of those due", ("rank",)),
    "memckpt_snapshots_skipped": (
        "counter", "due snapshots skipped (the previous one still sealing or not yet "
        "committed)", ("rank",)),
    "memckpt_replicated_bytes": (
        "counter", "snapshot bytes sent to peer replica stores", ("rank",)),
    "memckpt_replication_lag_steps": (
        "gauge", "newest step any rank reached minus the last committed step", ()),
    "memckpt_committed_step": ("gauge", "last step every rank's shard and replicas hold", ()),
    "memckpt_failures": (
        "counter", "failures detected, by what died: worker, node, hung, unreachable, peer, "
        "coordinator", ("target",)),
    "memckpt_recovery_phase_seconds": (
        "gauge", "duration of each phase of the last recovery (detect, stop, plan, resume, "
        "total)", ("phase",)),
}


def failure_target(what: str) -> str:
    """What a ``failure_detected`` event's text says died (a dead node shows up later,
    in the recovery plan's ``dead_nodes``)."""
    for marker, target in (("hung", "hung"), ("unreachable", "unreachable"),
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
        # (report key, rank) -> the cumulative count last reported
        self._sent: dict[tuple[str, int], float] = {}
        self._pending_failure: Optional[str] = None

    def step(self, rank: int, report: Mapping[str, float]) -> None:
        """One rank's per-step report (``stall_s``; ``replicated_bytes``, ``landed`` and
        ``skipped`` are cumulative per worker process, so a replaced worker starts again
        from 0)."""
        tags = {"rank": str(rank)}
        if "stall_s" in report:
            self._m["memckpt_snapshot_stall_seconds"].observe(report["stall_s"], tags=tags)
        for key, name in (("replicated_bytes", "memckpt_replicated_bytes"),
                          ("landed", "memckpt_snapshots_landed"),
                          ("skipped", "memckpt_snapshots_skipped")):
            count = report.get(key)
            if count is None:
                continue
            last = self._sent.get((key, rank), 0.0)
            delta = count - last if count >= last else count
            self._sent[(key, rank)] = count
            if delta > 0:
                self._m[name].inc(delta, tags=tags)

    def progress(self, newest_step: int, committed: Optional[int]) -> None:
        self._m["memckpt_committed_step"].set(committed if committed is not None else -1)
        if newest_step >= 0:
            self._m["memckpt_replication_lag_steps"].set(newest_step - (committed or 0))

    def event(self, kind: str, fields: Mapping[str, Any]) -> None:
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
