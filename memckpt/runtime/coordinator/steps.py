"""The coordinator's record of the steps the ranks finished, from the nodes' step summaries
(:mod:`memckpt.policy.step_metrics`): rank 0's loss per step (``losses.jsonl``), each
complete step's min / median / max snapshot stall over the ranks (``steps.jsonl``), the
counters and stalls of the Ray metrics, and what ``progress`` shows. Not persisted beyond
those files: a restarted coordinator reloads the losses and starts the rest afresh.

Everything here is O(1) per summary (a node's, whatever its ranks) and ``progress`` reads
counters kept up to date, never a walk over ranks or nodes: the driver polls it ten times a
second. Progress is kept per *unit*, a node that sends its ranks' summaries (or a rank with
no store on its node, which reports alone).
"""

from __future__ import annotations

import json
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional

from memckpt.policy.step_metrics import StallTally, StepSummary, summarize
from memckpt.runtime.coordinator.messages import Progress, UnitStatus
from memckpt.runtime.coordinator.metrics import JobMetrics

METRICS_EVERY_S = 1.0  # the Ray metrics are fed at most this often


@dataclass
class UnitProgress:
    """A node's (or a lone rank's) latest step summary, as ``memckpt status`` shows it."""

    step: int
    ranks: int
    stall_max_s: float
    time: float
    landed: float = 0.0
    requested: float = 0.0

    def status(self, now: float) -> UnitStatus:
        """As ``memckpt status`` shows it: the fields, and the age of the report at ``now``."""
        return UnitStatus(step=self.step, ranks=self.ranks, stall_max_s=self.stall_max_s,
                          time=self.time, landed=self.landed, requested=self.requested,
                          age_s=now - self.time)


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
        self.units: dict[str, UnitProgress] = {}  # node (or lone rank) -> its latest step
        self._at: Counter[int] = Counter()  # step -> units whose latest step it is
        self._covered = 0  # ranks the units' latest summaries cover (min_step needs them all)
        self.newest = -1  # the newest step any rank of this generation finished
        self._stalls: dict[int, StallTally] = {}  # step -> its stalls so far, until complete
        self._stall_max = (-1, -1.0)  # (the newest step with a stall, its max so far)
        self._pace: deque[tuple[float, int]] = deque(maxlen=64)  # rank 0's (time, step)
        # snapshots due ("requested"), landed and skipped over every rank, the whole job
        self.snapshots: dict[str, float] = {"requested": 0.0, "landed": 0.0, "skipped": 0.0}
        self._unsent: dict[str, float] = {}  # counter increases not yet in the Ray metrics
        self._sent_at = float("-inf")

    def reset(self) -> None:
        """A generation starts (its losses stay: the file's last line per step wins)."""
        self.job_metrics.counted(self._unsent)  # the ended generation's counts
        self._unsent.clear()
        self.units.clear()
        self._at.clear()
        self._covered = 0
        self.newest = -1
        self._resumed = None  # the step this generation resumed from: not known yet
        self._stalls.clear()
        self._stall_max = (-1, -1.0)
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

    def orphaned(self, gen: int, summaries: Iterable[StepSummary]) -> None:
        """Summaries of generation ``gen``, refused because it had ended. A step's summary
        rides the next step's batch, so the failure can take the loss of the step before
        the resumed one as well (#38): kept aside, and a loss of the generation just before
        the current one is taken for a step up to the one the current generation resumed
        from (those steps are the run's history; the later ones are redone)."""
        for m in summaries:
            if m.loss is not None:
                self._orphans[m.step] = (gen, m.loss)
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

    def summarize(self, rank: int, step: int, report: Mapping[str, float]) -> StepSummary:
        """One rank's own report as a summary (a worker with no store on its node)."""
        return summarize(step, {rank: report})

    def take(self, gen: int, unit: str, summaries: Iterable[StepSummary], world_size: int,
             committed: Optional[int]) -> None:
        """Step summaries of ``unit`` (a node, or ``rank <r>``): rank 0's loss to
        losses.jsonl, the unit's progress (status, progress), the counters to the Ray
        metrics; a step's line in steps.jsonl once every rank's stall is in."""
        now = time.time()
        for m in summaries:
            step = m.step
            if m.loss is not None:
                # A file, not the GCS: one small append per step, and it outlives the
                # process. After a rollback the redone steps are appended again; the last
                # line wins.
                self.losses[str(step)] = m.loss
                with open(self.run_dir / "losses.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "loss": m.loss, "gen": gen}) + "\n")
            self._advance(unit, m, now)
            if m.has_rank0:
                self._pace.append((now, step))
            self.newest = max(self.newest, step)
            for key, value in m.counters:
                self._unsent[key] = self._unsent.get(key, 0.0) + value
                if key in self.snapshots:
                    self.snapshots[key] += value
            if m.stalls.n:
                self._record_stalls(gen, m, world_size, now)
        if now - self._sent_at >= METRICS_EVERY_S:
            self._send_metrics(now, committed)

    def flush(self, committed: Optional[int]) -> None:
        """What the Ray metrics have not had yet, now (a generation or the job ends)."""
        self._send_metrics(time.time(), committed)

    def _send_metrics(self, now: float, committed: Optional[int]) -> None:
        """The counters and progress to the Ray metrics, at most once per
        METRICS_EVERY_S: a few calls a second, not a few per node per step."""
        self.job_metrics.counted(self._unsent)
        self.job_metrics.progress(self.newest, committed)
        self._unsent.clear()
        self._sent_at = now

    def _advance(self, unit: str, m: StepSummary, now: float) -> None:
        """``unit`` reached ``m.step``: the counters min_step is read from, in O(1) (in
        place: once per node a step, at thousands of nodes)."""
        counts = dict(m.counters)
        u = self.units.get(unit)
        if u is None:
            u = self.units[unit] = UnitProgress(m.step, 0, 0.0, now)
            self._at[m.step] += 1
        elif m.step > u.step:
            at = self._at
            at[u.step] -= 1
            if not at[u.step]:
                del at[u.step]
            at[m.step] += 1
            u.step = m.step
        self._covered += m.ranks - u.ranks
        u.ranks, u.time = m.ranks, now
        u.stall_max_s = m.stalls.hi if m.stalls.n else 0.0
        u.landed += counts.get("landed", 0.0)
        u.requested += counts.get("requested", 0.0)

    def _record_stalls(self, gen: int, m: StepSummary, world_size: int, now: float) -> None:
        """One line per step in steps.jsonl, once every rank's stall is in (ranks report in
        order, so an older step still incomplete then never will be: dropped)."""
        got = self._stalls.setdefault(m.step, StallTally())
        got.add(m.stalls)
        if m.step >= self._stall_max[0]:
            self._stall_max = (m.step, got.hi)
        if got.n < world_size:
            return
        for old in [s for s in self._stalls if s <= m.step]:
            del self._stalls[old]
        stats = got.stats()
        self.job_metrics.stalls(stats)
        with open(self.run_dir / "steps.jsonl", "a") as f:
            f.write(json.dumps({"step": m.step, "gen": gen, "time": now, "ranks": got.n,
                                "stall_s": stats}) + "\n")

    def progress(self, gen: int, world_size: int, committed: Optional[int]) -> Progress:
        """``Coordinator.progress``'s answer, from counters kept as summaries arrive."""
        newest = max(self._at, default=-1)
        recent = [(t, s) for t, s in self._pace if t > time.time() - 5.0]  # the last 5 s
        rate = None
        if len(recent) > 1 and recent[-1][0] > recent[0][0]:
            rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        stall = self._stall_max[1]
        return Progress(gen, committed,
                        min_step=min(self._at) if self._at and self._covered >= world_size else -1,
                        max_step=newest, last_loss=self.losses.get(str(newest)),
                        steps_per_s=rate, stall_ms=stall * 1000 if stall >= 0 else None,
                        lag=newest - (committed or 0) if newest >= 0 else None)
