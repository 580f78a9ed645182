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
import time
from typing import Any, Callable, Mapping, Optional

from memckpt.errors import MemckptError
from memckpt.runtime.node.uplink import COMMIT_GROUP
from memckpt.runtime.worker.spec import WorkerSpec

WAIT_S = 5.0  # one wait for a commit answer
CALL_S = 30.0  # a store's answer to a call that only records
STORE_SILENT_S = 120.0  # a store silent this long (through retries) fails the rank

View = tuple[Optional[int], Optional[int], Optional[str]]
log = logging.getLogger(__name__)


class NodeLink:
    """``ready`` (the commit answer), ``report`` and ``beat`` of one rank."""

    def __init__(self, spec: WorkerSpec, node_id: str) -> None:
        self.spec = spec
        self.store: Any = spec.stores.get(node_id) if spec.node_ranks else None
        self._joined = False
        self._beat: Any = None  # the last beat's answer

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
        self._joined = bool(ray.get(self.store.join.remote(
            spec.rank, spec.gen, list(spec.node_ranks), spec.coordinator,
            spec.config.failure.heartbeat_interval_s), timeout=CALL_S))
        return self._joined

    def ready(self, step: int, holders: list[str], cancelled: Callable[[], bool]) -> Optional[View]:
        """This rank's shard of ``step`` is placed on ``holders``: wait for the step's commit.
        Returns (committed, step to persist or None, action), or None when the wait ended
        unanswered: the generation is over (cancelled, or the coordinator says stale)."""
        import ray
        spec = self.spec
        if self.store is None:
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
                return None if got[2] == "stale" else got
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
        """This rank finished ``step`` (fire and forget, as the heartbeat)."""
        spec = self.spec
        if self.store is None:
            spec.coordinator.report.remote(spec.rank, spec.gen, step, dict(metrics))
        else:
            self.store.report.remote(spec.rank, spec.gen, step, dict(metrics), snapshotted)

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
