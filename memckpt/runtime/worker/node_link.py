"""A rank's line to the control plane: through its node's replica store, which gathers the
node's ranks into one message per step and one heartbeat per interval at the coordinator
(:mod:`memckpt.runtime.node.uplink`); straight to the coordinator, per rank, when the spec
names no store for this node or no ranks on it (an older spec).

Every wait is bounded: a store that answers nothing for :data:`STORE_SILENT_S` fails the
rank loudly instead of the step waiting forever (a frozen node is found sooner: its store's
heartbeat stops, see ``Coordinator.liveness``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Mapping, Optional

from memckpt.errors import MemckptError
from memckpt.policy.step_metrics import increments, without_counters
from memckpt.runtime.wire.calls import COMMIT_GROUP
from memckpt.runtime.worker.spec import WorkerSpec

WAIT_S = 5.0  # one wait for a commit answer
CALL_S = 30.0  # a store's answer to a call that only records
STORE_SILENT_S = 120.0  # a store silent this long (through retries) fails the rank
KEEP_REPORTS = 256  # a rank's reports kept for a restarted store (see NodeLink.report)

View = tuple[Optional[int], Optional[int], Optional[str]]
log = logging.getLogger(__name__)


class NodeLink:
    """``ready`` (the commit answer), ``report`` and ``beat`` of one rank."""

    def __init__(self, spec: WorkerSpec, node_id: str) -> None:
        self.spec = spec
        self.store: Any = spec.stores.get(node_id) if spec.node_ranks else None
        self._joined = False
        self._beat: Any = None  # the last beat's answer
        self._lock = threading.Lock()  # report (training thread), ready, beat: each a thread
        self._committed = -1  # the newest commit this rank was answered
        # (step, metrics, snapshotted, the store's answer) of steps not yet committed
        self._kept: deque[tuple[int, dict[str, float], bool, Any]] = deque(maxlen=KEEP_REPORTS)
        self._counts: dict[str, float] = {}  # the counters' last cumulative values sent

    def start(self) -> "NodeLink":
        """Join the node's store now (before the rank's first report or heartbeat). A store
        that does not answer (restarting) is joined later, by the first beat or readiness
        it refuses; one gone for good leaves this rank silent: found hung."""
        if self.store is not None:
            try:
                self.join()
            except Exception as e:  # noqa: BLE001 - see above
                log.warning("memckpt: rank %d could not join its node's store yet: %r",
                            self.spec.rank, e)
        return self

    def join(self) -> bool:
        """Tell the node's store this rank's generation and its node's ranks (again after
        the store restarted). False: the generation is over."""
        import ray
        spec = self.spec
        with self._lock:
            failure = spec.config.failure
            self._joined = bool(ray.get(self.store.join.remote(
                spec.rank, spec.gen, list(spec.node_ranks), spec.coordinator,
                failure.heartbeat_interval_s, os.getpid(), failure.heartbeat_timeout_s,
                list(spec.holders), self._relay()),
                timeout=CALL_S))
            if self._joined:  # a restarted store lost what it held: this rank's reports again
                kept = list(self._kept)
                self._kept.clear()
                for step, metrics, snapshotted, _ in kept:  # counted once at most
                    self._send_report(step, without_counters(metrics), snapshotted)
        return self._joined

    def _relay(self) -> Optional[tuple[list[str], Any]]:
        """The node's relay group and its leader's store, as the store's ``join`` takes it
        (None: no relay, or the leader's store is not known)."""
        group = self.spec.relay
        leader = self.spec.stores.get(group[0]) if group else None
        return (list(group), leader) if leader is not None else None

    def ready(self, step: int, holders: list[str], cancelled: Callable[[], bool]) -> Optional[View]:
        """This rank's shard of ``step`` is placed on ``holders``: wait for the step's commit.
        Returns (committed, step to persist or None, action), or None when the wait ended
        unanswered: the generation is over (cancelled, or the coordinator says stale)."""
        import ray
        spec = self.spec
        # The restored step, copied out again to the holders placement moved (a rank's own
        # choice: its node-mates may not resend it, so no node batch would complete). It is
        # committed already: the coordinator answers this rank at once. Once per recovery.
        again = spec.restore is not None and step <= spec.restore.step
        if self.store is None or again:
            view = ray.get(spec.coordinator.shard_ready.remote(spec.rank, spec.gen, step, holders))
            while not self._settled(view, step):
                if cancelled():
                    return None
                view = ray.get(spec.coordinator.wait_commit.remote(spec.gen, step, WAIT_S))
            return None if view[2] == "stale" else view
        silent_since = time.monotonic()
        while not cancelled():
            try:
                if not self._joined and not self.join():
                    return None
                if not ray.get(self.store.rank_ready.remote(spec.rank, spec.gen, step, holders),
                               timeout=CALL_S):
                    self._joined = False  # a restarted store: join, then say it again
                    time.sleep(0.1)
                    continue
                got = ray.get(self.store.wait_commit.options(concurrency_group=COMMIT_GROUP)
                              .remote(spec.gen, step, WAIT_S), timeout=WAIT_S + CALL_S)
                silent_since = time.monotonic()
            except ray.exceptions.GetTimeoutError:
                got = None
            if got is not None and self._settled(got, step):
                if got[2] == "stale":
                    return None
                self._committed = max(self._committed, got[0])
                return got
            if time.monotonic() - silent_since > STORE_SILENT_S:
                raise MemckptError(
                    f"rank {spec.rank}: its node's replica store did not answer for "
                    f"{STORE_SILENT_S:.0f} s, so step {step} cannot commit: check that node's "
                    "raylet and the store actor's log (`ray logs`), or restart the job from "
                    "its persisted tier")
        return None

    @staticmethod
    def _settled(view: Any, step: int) -> bool:
        return view[2] == "stale" or (view[0] is not None and view[0] >= step)

    def report(self, step: int, metrics: Mapping[str, float], snapshotted: bool) -> None:
        """This rank finished ``step`` (fire and forget, as the heartbeat). Through a store,
        each report is kept until its step commits: a store that restarts (or refused one,
        not knowing this rank) loses what it held, so after the rank joins it again the
        kept reports go again (the coordinator keeps a step's last loss: no double; their
        counters' increases are left out, as the old store may have passed them on: the
        snapshot counters may miss those few steps, never count one twice). The answers
        are looked at on the next report, never waited for."""
        spec = self.spec
        metrics = increments(metrics, self._counts)
        if self.store is None:
            spec.coordinator.report.remote(spec.rank, spec.gen, step, metrics)
            return
        with self._lock:  # a committed step's report goes once its answer was looked at:
            # one a restarted store refused is sent again even if its step committed since
            while self._kept and self._kept[0][0] <= self._committed and self._kept[0][3] is None:
                self._kept.popleft()
            self._send_report(step, metrics, snapshotted)
        try:
            self._rejoin_if_refused(0.0)
        except Exception as e:  # noqa: BLE001 - restarting: the next report or beat
            log.warning("memckpt: rank %d could not join its node's store again: %r",
                        spec.rank, e)

    def flush(self) -> None:
        """The rank's run ended: its reports are at the store and what the store holds is at
        the coordinator before the rank returns (the driver reads the losses next). Bounded;
        a store that does not answer costs metrics, never the run."""
        import ray
        if self.store is None:
            return
        spec = self.spec
        try:
            self._rejoin_if_refused(CALL_S)
            ray.get(self.store.flush.remote(spec.gen, CALL_S), timeout=2 * CALL_S)
        except Exception as e:  # noqa: BLE001 - see above
            log.warning("memckpt: rank %d could not flush its step reports through its "
                        "node's store: %r", spec.rank, e)

    def _rejoin_if_refused(self, timeout_s: float) -> None:
        """Look at the store's answers to the kept reports (those in within ``timeout_s``;
        each answer is looked at once): if it refused one (it restarted and does not know
        this rank) or died with the call, join it again, which sends the kept reports
        again."""
        import ray
        refused = False
        with self._lock:
            answers = [k[3] for k in self._kept if k[3] is not None]
            if not answers:
                return
            done, _ = ray.wait(answers, num_returns=len(answers), timeout=timeout_s)
            for ref in done:
                try:
                    refused = not ray.get(ref) or refused
                except Exception:  # noqa: BLE001 - the store died with the call
                    refused = True
            seen = set(done)
            self._kept = deque(((st, m, sn, None if ref in seen else ref)
                                for st, m, sn, ref in self._kept), maxlen=KEEP_REPORTS)
        if refused:
            self._joined = False
            self.join()

    def _send_report(self, step: int, metrics: dict[str, float], snapshotted: bool) -> None:
        spec = self.spec
        ref = self.store.report.remote(spec.rank, spec.gen, step, metrics, snapshotted)
        self._kept.append((step, metrics, snapshotted, ref))

    def beat(self, step: int) -> None:
        """This rank is alive at ``step`` (the heartbeat thread, every interval). A store
        that answered the last beat with False restarted: join it again, or its heartbeat
        would leave this rank out. Never raises: the next beat tries again."""
        import ray
        spec = self.spec
        if self.store is None:
            spec.coordinator.heartbeat.remote(spec.rank, spec.gen, step)
            return
        try:
            last, self._beat = self._beat, None
            if last is not None and ray.wait([last], timeout=0)[0] and not ray.get(last):
                self.join()
            self._beat = self.store.beat.remote(spec.rank, spec.gen, step)
        except Exception:  # noqa: BLE001 - a store restarting or gone: the next beat
            pass
