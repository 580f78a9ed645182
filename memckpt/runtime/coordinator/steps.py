"""The coordinator's record of the steps the ranks finished, from the nodes' step summaries
(:mod:`memckpt.policy.step_metrics`): rank 0's loss per step (``losses.jsonl``), each
complete step's min / median / max snapshot stall over the ranks (``steps.jsonl``), the
counters and stalls of the Ray metrics, and what ``progress`` shows. Not persisted beyond
those files: a restarted coordinator reloads the losses and starts the rest afresh.
"""

from __future__ import annotations

import json
import time
from collections import deque
from pathlib import Path
from typing import Any, Mapping, Optional

from memckpt.policy.step_metrics import Summary, stall_stats, summarize
from memckpt.runtime.coordinator.metrics import JobMetrics


class StepLog:
    """One job's steps, as the coordinator hears of them. O(ranks in a summary) per call."""

    def __init__(self, run_dir: Path, job_metrics: JobMetrics) -> None:
        self.run_dir = run_dir
        self.job_metrics = job_metrics
        self.losses: dict[str, float] = {}  # step -> loss, appended to losses.jsonl
        # rank 0's losses in messages refused because their generation had ended, and the
        # step the current generation resumed from: see adopt()
        self._orphans: dict[int, tuple[int, float]] = {}  # step -> (gen, loss)
        self._resumed: Optional[tuple[int, int]] = None  # (gen, step)
        self.metrics: dict[str, dict[str, float]] = {}  # rank -> its latest step and stall
        self.newest = -1  # the newest step any rank of this generation finished
        self._stalls: dict[int, dict[int, float]] = {}  # step -> rank -> stall_s, until complete
        self._pace: deque[tuple[float, int]] = deque(maxlen=64)  # rank 0's (time, step)
        # snapshots due ("requested"), landed and skipped over every rank, the whole job
        self.snapshots: dict[str, float] = {"requested": 0.0, "landed": 0.0, "skipped": 0.0}

    def reset(self) -> None:
        """A generation starts (its losses stay: the file's last line per step wins)."""
        self.metrics.clear()
        self.newest = -1
        self._resumed = None  # the step this generation resumed from: not known yet
        self._stalls.clear()
        self._pace.clear()

    def reload_losses(self) -> None:
        path = self.run_dir / "losses.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by the crash
                self.losses[str(rec["step"])] = rec["loss"]

    def restored(self, gen: int, step: int, loss: float) -> bool:
        """Rank 0's ``loss`` of the step a recovery resumed from, read back from its
        snapshot (that step's own summary may have been lost with the generation the
        failure ended). Taken for a step this run did: not one before the first step it
        heard of (the step an auto-resume started from was another run's)."""
        if not self.losses or step < min(int(s) for s in self.losses):
            return False
        if self.losses.get(str(step)) != loss:
            self._write_restored(gen, step, loss)
        self._resumed = (gen, step)
        self._adopt()
        return True

    def orphaned(self, gen: int, summaries: list[Summary]) -> None:
        """Summaries of generation ``gen``, refused because it had ended. A step's summary
        rides the next step's batch, so the failure can take the loss of the step before
        the resumed one as well (#38): kept aside, and a loss of the generation just before
        the current one is taken for a step up to the one the current generation resumed
        from (those steps are the run's history; the later ones are redone)."""
        for m in summaries:
            if "loss" in m:
                self._orphans[int(m["step"])] = (gen, m["loss"])
        self._adopt()

    def _adopt(self) -> None:
        if self._resumed is None or not self.losses:
            return
        gen, resumed = self._resumed
        first = min(int(s) for s in self.losses)
        for step, (their_gen, loss) in sorted(self._orphans.items()):
            if their_gen == gen - 1 and first <= step <= resumed and str(step) not in self.losses:
                self._write_restored(gen, step, loss)
        self._orphans = {s: v for s, v in self._orphans.items() if v[0] >= gen}

    def _write_restored(self, gen: int, step: int, loss: float) -> None:
        self.losses[str(step)] = loss
        with open(self.run_dir / "losses.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "loss": loss, "gen": gen,
                                "restored": True}) + "\n")

    def summarize(self, rank: int, step: int, report: Mapping[str, float]) -> Summary:
        """One rank's own report as a summary (a worker with no store on its node)."""
        return summarize(step, {rank: report})

    def take(self, gen: int, summaries: list[Summary], world_size: int,
             committed: Optional[int]) -> None:
        """Step summaries of some ranks: rank 0's loss to losses.jsonl, each rank's step
        and stall (status, progress), the counters to the Ray metrics; a step's line in
        steps.jsonl once every rank's stall is in."""
        now = time.time()
        for m in summaries:
            step = int(m["step"])
            if "loss" in m:
                # A file, not the GCS: one small append per step, and it outlives the
                # process. After a rollback the redone steps are appended again; the last
                # line wins.
                self.losses[str(step)] = m["loss"]
                with open(self.run_dir / "losses.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "loss": m["loss"], "gen": gen}) + "\n")
            stalls = {int(r): v for r, v in m.get("stall_s", {}).items()}
            for r, v in stalls.items():
                self.metrics[str(r)] = {"step": step, "stall_s": v, "time": now}
            if 0 in stalls:
                self._pace.append((now, step))
            self.newest = max(self.newest, step)
            for key in self.snapshots:
                self.snapshots[key] += m.get(key, 0.0)
            self.job_metrics.counted(m)
            if stalls:
                self._record_stalls(gen, step, stalls, world_size, now)
        self.job_metrics.progress(self.newest, committed)

    def _record_stalls(self, gen: int, step: int, stalls: dict[int, float], world_size: int,
                       now: float) -> None:
        """One line per step in steps.jsonl, once every rank's stall is in (ranks report in
        order, so an older step still incomplete then never will be: dropped)."""
        got = self._stalls.setdefault(step, {})
        got.update(stalls)
        if len(got) < world_size:
            return
        for old in [s for s in self._stalls if s <= step]:
            del self._stalls[old]
        stats = stall_stats(list(got.values()))
        self.job_metrics.stalls(stats)
        with open(self.run_dir / "steps.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "gen": gen, "time": now, "ranks": len(got),
                                "stall_s": stats}) + "\n")

    def progress(self, world_size: int, committed: Optional[int]) -> dict[str, Any]:
        """The fields of ``Coordinator.progress`` from the steps heard of."""
        steps = [m.get("step", -1) for m in self.metrics.values()]
        newest = max(steps, default=-1)
        stalls = [m["stall_s"] for m in self.metrics.values() if "stall_s" in m]
        recent = [(t, s) for t, s in self._pace if t > time.time() - 5.0]  # the last 5 s
        rate = None
        if len(recent) > 1 and recent[-1][0] > recent[0][0]:
            rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        return {"min_step": min(steps) if len(steps) == world_size else -1,
                "max_step": newest, "last_loss": self.losses.get(str(newest)),
                "steps_per_s": rate, "stall_ms": max(stalls) * 1000 if stalls else None,
                "lag": newest - (committed or 0) if newest >= 0 else None}
