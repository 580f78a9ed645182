"""The replica store's line to the coordinator: it hosts the node's
:class:`~memckpt.runtime.node.aggregator.NodeAggregator` and sends what that gathers, one
message per node per step and one heartbeat per interval (see the aggregator).

Threads. The store is a threaded actor. Calls that record (``rank_ready``, ``report``,
``beat``, ``join``) only take a lock and submit a Ray call without waiting on it: they
never block its default threads, which serve replica writes and restores. A rank that
waits for its commit answer calls ``wait_commit`` in the store's own concurrency group
(:data:`~memckpt.runtime.wire.calls.COMMIT_GROUP`): the batch's ``node_ready`` call
returns the answer (the coordinator holds it until the step commits, up to
:data:`COMMIT_WAIT_S`), and every waiter of that step ``ray.get``s the same reference. A
wait never holds the lock, and the call that completes a batch is never queued behind
waiters, so however many ranks a node has, readiness gets through. Every wait is bounded:
a rank whose store or coordinator does not answer fails loudly (:mod:`memckpt.runtime.worker.node_link`).

The coordinator is the handle a rank passed at ``join`` (its ``WorkerSpec``'s): Ray
restarts the coordinator in place behind the same named handle, and calls in flight are
retried (``max_task_retries=-1``). A heartbeat thread sends the node's heartbeat every
interval once a generation joined.

Every :data:`FOOTPRINT_EVERY_S` a heartbeat also carries what the node's memckpt files hold
in RAM and the node's budget for them (the store's ``footprint``: a few stat calls), for
``memckpt status`` and ``memckpt report``.

A rank late to beat is looked at on its node each interval from then on: its silence goes
to the coordinator net of what its process waited for a CPU (:mod:`memckpt.policy.liveness`),
so a rank starved by something else on the node is not taken for a hung one.

On a large job the store's batches go through its group's leader
(:mod:`memckpt.policy.relay_groups`, :mod:`memckpt.runtime.node.relay`), given at ``join``: the
leader answers with the coordinator's reference once the group's message went. A leader
that does not answer within :attr:`Uplink.relay_patience_s`, that died, or whose answer
cannot be read (it owned the reference) costs one resend: the store sends the batch to the
coordinator itself, and every batch after it for the rest of the generation (the event
``relay_bypassed`` says so, once). A leader that does not know the group yet (its ranks
joined later) is bypassed for that step only. A step's summaries can then reach the
coordinator twice (counters of that step counted twice, losses rewritten with the same
value): a failure's cost, never a wrong commit (readiness is a node's count, set, not added).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from memckpt.policy.liveness import LATE_BEATS, ProcSample, StarvationCredit, net_silence
from memckpt.policy.step_metrics import StepSummary, summarize
from memckpt.runtime.node import procstat
from memckpt.runtime.coordinator.messages import ReadyBatch
from memckpt.runtime.node.aggregator import Heartbeat, NodeAggregator
from memckpt.runtime.node.relay import RelayPoint
from memckpt.runtime.wire.calls import COMMIT_GROUP

FLUSH_POLL_S = 0.02  # a flush looks this often whether the relayed summaries went
COMMIT_WAIT_S = 5.0  # the coordinator holds a node_ready / wait_commit this long at most
KEEP_ANSWERS = 4  # commit answers kept per generation (a few steps in flight)
FOOTPRINT_EVERY_S = 5.0  # the node's RAM held and budget ride a heartbeat at most this often

View = tuple[Optional[int], Optional[int], Optional[str]]
Get = Callable[[Any, float], Any]  # (a call's reference, timeout) -> its answer; TimeoutError
Sample = Callable[[int], Optional[ProcSample]]  # a pid -> its state and CPU waits, or None
Footprint = Callable[[], tuple[int, int]]  # () -> (bytes memckpt holds on the node, budget)
# a node's relay group at join: (its members, leader first; the leader's store handle)
Relay = tuple[Sequence[str], Any]
PENDING = object()  # a leader's answer not in yet, within its patience


def ray_get(ref: Any, timeout_s: float) -> Any:
    import ray
    return ray.get(ref, timeout=timeout_s)  # GetTimeoutError is a TimeoutError


class Uplink:
    """One node's aggregation toward the coordinator (thread-safe). ``coordinator`` (given
    at ``join``) is called as an actor handle (``.method.remote(...)``), whose references
    ``get`` resolves (default: ``ray.get``); ``sample`` looks at a rank's process (default:
    :func:`memckpt.runtime.node.procstat.sample`); ``footprint``, when given, measures the
    node's memckpt RAM and budget for a heartbeat every :data:`FOOTPRINT_EVERY_S`;
    ``beat_thread``: False leaves the ticks (:meth:`tick`, every interval) to the caller
    (a simulation of many nodes in one process)."""

    def __init__(self, node: str, clock: Callable[[], float] = time.monotonic,
                 get: Get = ray_get, sample: Sample = procstat.sample,
                 footprint: Optional[Footprint] = None, beat_thread: bool = True) -> None:
        self.node = node
        self.clock = clock
        self.get = get
        self.sample = sample
        self.footprint = footprint
        self._ram_at = float("-inf")  # when the footprint was last measured
        self.agg = NodeAggregator(node)
        self.coordinator: Any = None
        self.interval_s = 0.5
        self.timeout_s = 5.0  # the job's heartbeat timeout (given at join)
        self._pids: dict[int, int] = {}  # this generation's ranks' processes on this node
        self._credits: dict[int, StarvationCredit] = {}  # late ranks: their CPU waits
        self._excused: set[tuple[int, int]] = set()  # (gen, rank) said starved once
        self.floor = -1  # generations below it are fenced off (set_generation)
        self._cond = threading.Condition()
        self._answers: dict[tuple[int, int], Any] = {}  # (gen, step) -> ref of the answer
        self._thread: Optional[threading.Thread] = None
        self._beat_thread = beat_thread
        self._closed = threading.Event()
        self._beat: Optional[tuple[int, Any]] = None  # (gen, ref of the answer) of the last beat
        self._spoke_at = float("-inf")  # when a batch or metrics last went (a sign of life)
        self.relay = RelayPoint(node, clock)  # where this node leads a group: its merging
        self._relay_to: Optional[tuple[int, Any]] = None  # (gen, the leader's store) to send to
        self._bypassed = -1  # the newest generation whose relay failed: batches go direct
        # (gen, step) -> (the leader's answer, the batch, when sent): not resolved yet
        self._relayed: dict[tuple[int, int], tuple[Any, ReadyBatch, float]] = {}
        self._batches: dict[tuple[int, int], ReadyBatch] = {}  # relayed batches, kept to resend
        # step summaries handed to the leader alone, until the coordinator took them: (the
        # leader's answer, the batch, when sent, the coordinator's reference once answered)
        self._metrics_relayed: list[tuple[Any, ReadyBatch, float, Any]] = []
        self._settling = threading.Lock()

    # -- called by the node's ranks -------------------------------------------------------
    def join(self, rank: int, gen: int, ranks: Iterable[int], coordinator: Any,
             interval_s: float, pid: Optional[int] = None,
             timeout_s: Optional[float] = None,
             holders: Optional[Sequence[str]] = None, relay: Optional[Relay] = None) -> bool:
        """``rank`` (process ``pid``) starts generation ``gen`` with ``ranks`` on this node;
        ``interval_s``, ``timeout_s``: the job's heartbeat settings; ``holders``: the nodes
        its spec places its shards on (its readiness is judged against them here; without
        them, where it placed goes to the coordinator to judge); ``relay``: the node's relay
        group and its leader's store (None: batches go to the coordinator). False: fenced."""
        with self._cond:
            if gen < self.floor:
                return False
            old, held = self.agg.gen, (self.agg.take_ended() if gen > self.agg.gen else [])
            if not self.agg.join(gen, ranks, self.clock()):
                return False
            if held and self.coordinator is not None:
                # the ended generation's summaries still held: the coordinator keeps their
                # losses for the steps the new one resumed from
                self.coordinator.ended_metrics.remote(self.node, old, tuple(held))
            if gen > old:
                self._pids.clear()
                self._credits.clear()
                self._excused = {k for k in self._excused if k[0] >= gen}
            if gen == self.agg.gen:
                self.coordinator, self.interval_s = coordinator, interval_s
                self.timeout_s = timeout_s or self.timeout_s
                if pid is not None:
                    self._pids[rank] = pid
                if holders is not None:
                    self.agg.expect(rank, gen, holders)
                if relay is not None:
                    self._join_relay(gen, tuple(relay[0]), relay[1])
                self.agg.beat(rank, gen, -1, self.clock())  # alive from its own join
            if self._thread is None and self._beat_thread:
                self._thread = threading.Thread(target=self._beat_loop, daemon=True,
                                                name="memckpt-node-heartbeat")
                self._thread.start()
            self._cond.notify_all()
        return True

    def _join_relay(self, gen: int, members: tuple[str, ...], leader: Any) -> None:
        self._relay_to = (gen, leader)
        if members[0] == self.node:
            self.relay.configure(gen, members, self.interval_s, self._send_group)

    def _send_group(self, parts: dict[str, ReadyBatch]) -> Any:
        self._spoke_at = self.clock()
        return self.coordinator.group_ready.remote(self.node, tuple(parts.items()),
                                                   COMMIT_WAIT_S)

    def relay_ready(self, node: str, batch: ReadyBatch, timeout_s: float) -> Optional[Any]:
        """A member's batch, for this leader to merge: the coordinator's reference to the
        answer once the group's message went; None when this store does not lead ``node``
        for that generation (the member sends it itself)."""
        fut = self.relay.take(node, batch)
        try:
            return fut.result(timeout_s)
        except Exception:  # noqa: BLE001 - not its leader, or the send failed
            return None

    def _known(self, rank: int, gen: int) -> bool:
        return gen >= self.floor and self.agg.knows(gen, rank)

    def rank_ready(self, rank: int, gen: int, step: int, holders: list[str]) -> bool:
        """``rank``'s shard of ``step`` is placed on ``holders``; the node's batch goes once
        every local rank's is. False: this store does not know the rank (it restarted, or
        the generation is fenced): join again."""
        with self._cond:
            if not self._known(rank, gen):
                return False
            batch = self.agg.ready(rank, gen, step, holders, self.clock())
            if batch is not None:
                key = (gen, step)
                via = self._relay_via(gen)
                if via is None:
                    self._answers[key] = self._send_direct(batch)
                else:  # through the group's leader (the leader itself: in this process)
                    ref = self._to_relay(via, batch)
                    self._answers[key] = ref
                    self._relayed[key] = (ref, batch, self.clock())
                    self._batches[key] = batch
                for old in sorted(self._answers)[:-KEEP_ANSWERS]:
                    del self._answers[old]
                    self._relayed.pop(old, None)
                    self._batches.pop(old, None)
                self._cond.notify_all()
        return True

    def _relay_via(self, gen: int) -> Optional[Any]:
        """The leader's store to hand ``gen``'s batches to, or None: go direct (no relay,
        another generation's, or it failed this generation)."""
        via = self._relay_to
        return None if via is None or via[0] != gen or self._bypassed >= gen else via[1]

    def _to_relay(self, leader: Any, batch: ReadyBatch) -> Any:
        """Hand ``batch`` to the group's leader: its future in this process when this node
        leads, else the leader store's answer to ``relay_ready``."""
        if self.relay.gen == batch.gen and self.node in self.relay.members:
            return self.relay.take(self.node, batch)
        return leader.relay_ready.options(concurrency_group=COMMIT_GROUP).remote(
            self.node, batch, COMMIT_WAIT_S)

    def _send_direct(self, batch: ReadyBatch) -> Any:
        self._spoke_at = self.clock()
        return self.coordinator.node_ready.remote(self.node, batch, COMMIT_WAIT_S)

    @property
    def relay_patience_s(self) -> float:
        """How long a batch waits for its leader's answer before it goes direct: the leader
        sends within its wait (an interval) and one tick of its heartbeat thread."""
        return max(1.0, 3 * self.interval_s)

    def _via_relay(self, key: tuple[int, int], deadline: float) -> Optional[Any]:
        """The coordinator's reference for a relayed batch: the leader's answer, or the
        batch sent direct when the leader failed; None: not yet (ask again)."""
        with self._cond:
            entry = self._relayed.get(key)
            if entry is None:
                return self._answers.get(key)
        ref, batch, sent_at = entry
        coord, why = self._leader_answer(ref, sent_at, deadline)
        if coord is PENDING:
            return None
        with self._cond:
            if self._relayed.get(key) is not entry:  # another waiter settled it
                return self._answers.get(key)
            del self._relayed[key]
            if why is None and coord is not None:  # the leader sent it: the node spoke
                self._spoke_at = max(self._spoke_at, sent_at)
            if coord is None:
                self._batches.pop(key, None)  # resent: an error of its answer is raised
                coord = self._bypass(key, batch, why)
            self._answers[key] = coord
        return coord

    def _leader_answer(self, ref: Any, sent_at: float, until: float) -> tuple[Any, Optional[str]]:
        """The leader's answer to what was handed it at ``sent_at``, waited for until
        ``until`` at most (never past :attr:`relay_patience_s`): (the coordinator's
        reference, None); (None, None): it does not lead that generation; (None, why): it
        failed; (:data:`PENDING`, None): not yet, within its patience."""
        patience = sent_at + self.relay_patience_s
        try:
            wait = max(0.0, min(until, patience) - self.clock())
            return (ref.result(wait) if isinstance(ref, Future) else self.get(ref, wait)), None
        except TimeoutError:
            if self.clock() < patience:
                return PENDING, None
            return None, f"no answer in {self.relay_patience_s:g} s"
        except Exception as e:  # noqa: BLE001 - the leader died: go direct
            return None, repr(e)

    def _bypass(self, key: tuple[int, int], batch: ReadyBatch, why: Optional[str]) -> Any:
        """Send ``batch`` to the coordinator (see :meth:`_relay_failed`)."""
        self._relay_failed(batch, why)
        return self._send_direct(batch)

    def _relay_failed(self, batch: ReadyBatch, why: Optional[str]) -> None:
        """``why`` (the leader failed, not just unready for the step): the generation's
        batches go direct from now on, said once."""
        if why is not None and self._bypassed < batch.gen:
            self._bypassed = batch.gen
            self.coordinator.log_event.remote("relay_bypassed", {
                "gen": batch.gen, "step": batch.step, "node": self.node, "why": why})

    def report(self, rank: int, gen: int, step: int, metrics: Mapping[str, float],
               snapshotted: bool) -> bool:
        with self._cond:
            if not self._known(rank, gen):
                self._late_loss(rank, gen, step, metrics)
                return False
            out = self.agg.report(rank, gen, step, metrics, snapshotted, self.clock())
            if out:
                via = self._relay_via(gen)
                if via is None:
                    self._send_metrics(gen, tuple(out))
                else:  # a step's summaries alone: a batch that readies no rank
                    batch = ReadyBatch(gen, max(m.step for m in out), 0, "",
                                       metrics=tuple(out))
                    self._metrics_relayed.append((self._to_relay(via, batch), batch,
                                                  self.clock(), None))
        return True

    def _late_loss(self, rank: int, gen: int, step: int, metrics: Mapping[str, float]) -> None:
        """Rank 0's report of a generation that ended before it came (a report is fire
        and forget, and a busy store may take it after the recovery fenced its
        generation): its loss goes on as the ended generation's, as a join hands on what
        was held, for a step the new generation resumed from."""
        ended = gen < self.floor or gen < self.agg.gen
        if rank == 0 and "loss" in metrics and ended and self.coordinator is not None:
            self.coordinator.ended_metrics.remote(self.node, gen,
                                                  (summarize(step, {0: metrics}),))

    def _send_metrics(self, gen: int, summaries: tuple[StepSummary, ...]) -> None:
        self.coordinator.node_metrics.remote(self.node, gen, summaries)
        self._spoke_at = self.clock()

    def _settle_metrics(self) -> bool:
        """Summaries handed to the leader that it failed to send (it died, froze, or did not
        lead the generation) go direct; a failed leader is bypassed for the generation, as
        for a batch. Sent means the coordinator took them: a leader that answered and died
        before its message left (its reference dies with it) loses them otherwise, and no
        one waits on a step's summaries to notice (a step before the one a recovery resumes
        from is not redone: its loss would be gone). No one waits for these: looked at once
        a tick (and by a flush until none is left). True: some are still pending."""
        with self._settling:  # one at a time: a flush sees none pending only once all are
            return self._settle_metrics_now()

    def _settle_metrics_now(self) -> bool:
        with self._cond:
            pending, self._metrics_relayed = self._metrics_relayed, []
        kept = []
        for ref, batch, sent_at, taken in pending:
            why: Optional[str] = None
            if taken is None:
                taken, why = self._leader_answer(ref, sent_at, self.clock())
                if taken is PENDING:
                    kept.append((ref, batch, sent_at, None))
                    continue
            if taken is not None:
                answered, why = self._answered(taken)
                if not answered:
                    kept.append((ref, batch, sent_at, taken))
                    continue
                if why is None:  # the coordinator took them: the node spoke
                    with self._cond:
                        self._spoke_at = max(self._spoke_at, sent_at)
                    continue
                why = f"its answer was lost ({why})"
                # resent, not counted again: the coordinator may have taken the counters
                batch = replace(batch, metrics=tuple(replace(m, counters=())
                                                     for m in batch.metrics))
            with self._cond:
                self._relay_failed(batch, why)
                self._send_metrics(batch.gen, batch.metrics)
        with self._cond:
            self._metrics_relayed[:0] = kept
            return bool(self._metrics_relayed)

    def _answered(self, ref: Any) -> tuple[bool, Optional[str]]:
        """Whether the coordinator's answer to ``ref`` is in, and why it failed (None: it
        took the message). Never waits."""
        try:
            ref.result(0) if isinstance(ref, Future) else self.get(ref, 0.0)
        except TimeoutError:
            return False, None
        except Exception as e:  # noqa: BLE001 - the reference's owner (the leader) died
            return True, repr(e)
        return True, None

    def beat(self, rank: int, gen: int, step: int) -> bool:
        with self._cond:
            if not self._known(rank, gen):
                return False
            self.agg.beat(rank, gen, step, self.clock())
        return True

    def wait_commit(self, gen: int, step: int, timeout_s: float) -> Optional[View]:
        """The coordinator's answer for ``step`` (committed step, step to persist, action;
        action "stale": the generation is over), or None if the node's batch was not sent
        or not answered within ``timeout_s``: ask again. Runs in COMMIT_GROUP."""
        deadline = self.clock() + timeout_s
        key = (gen, step)
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._answers or gen < self.floor
                                       or gen < self.agg.gen or self._closed.is_set(),
                                       timeout_s):
                return None
            ref = self._answers.get(key)
            relayed = key in self._relayed
        if ref is None:
            return (None, None, "stale")
        if relayed and (ref := self._via_relay(key, deadline)) is None:
            return None
        try:
            view = tuple(self.get(ref, max(0.01, deadline - self.clock())))
        except TimeoutError:
            return None
        except Exception:  # noqa: BLE001 - a relayed answer lost with its leader: resent
            with self._cond:
                batch = self._batches.get(key)
                if batch is None:
                    raise  # the coordinator's own error
                if self._answers.get(key) is ref:  # else another waiter resent it
                    del self._batches[key]  # once: an error of the resent one is raised
                    self._answers[key] = self._bypass(key, batch, "its answer was lost")
            return None
        committed = view[0]
        if view[2] != "stale" and (committed is None or committed < step):
            # the coordinator's wait ran out (a slow node, its restart): one new wait for
            # every waiter of the step
            with self._cond:
                if self._answers.get((gen, step)) is ref:
                    self._answers[(gen, step)] = self.coordinator.wait_commit.remote(
                        gen, step, COMMIT_WAIT_S)
        return view

    def flush(self, gen: int, timeout_s: float) -> bool:
        """A rank's run ended: send what is held now and wait until the coordinator took it
        (and, Ray keeping one caller's calls in order, every message this store sent it
        before). False: ``gen`` is not this node's generation, or no answer in time."""
        with self._cond:
            if gen != self.agg.gen or gen < self.floor or self.coordinator is None:
                return False
            ref = self.coordinator.node_metrics.remote(self.node, gen,
                                                       tuple(self.agg.take_held()))
        deadline = self.clock() + timeout_s
        try:
            self.get(ref, timeout_s)
        except TimeoutError:
            return False
        # and the summaries handed to the group's leader: taken, or resent direct
        while self._settle_metrics():
            if self.clock() >= deadline:
                return False
            self._closed.wait(FLUSH_POLL_S)
        return True

    # -- the store ------------------------------------------------------------------------
    def fence(self, gen: int) -> None:
        """Generations below ``gen`` are over: their calls change nothing, their waiters go."""
        with self._cond:
            self.floor = max(self.floor, gen)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed.set()
            self._cond.notify_all()

    def heartbeat_once(self) -> bool:
        """Send the node's heartbeat now (the beat thread's tick); False if none is due.
        The coordinator's answer to the previous one is looked at first, never waited for:
        a refusal means its generation is over (this node froze or was cut off through the
        recovery), and the store fences it off itself, so a thawed node beats once, not for
        the rest of the job."""
        ram = self._footprint_if_due()  # outside the lock: it reads the file system
        with self._cond:
            self._fence_if_refused()
            coordinator = self.coordinator
            # a fenced generation's held summaries stay held: its ranks' next join sends
            # them (ended_metrics), or the resumed step's losses before them are lost
            if coordinator is None or self.agg.gen < self.floor or self._closed.is_set():
                return False
            now = self.clock()
            hb = self.agg.heartbeat(now, self.late_s)  # takes the held summaries
            if hb is None or self._said_enough(hb, now, ram):  # (said enough: none held)
                return False
            hb = replace(hb, late=self._net_of_starvation(hb, now), ram=ram)
            self._beat = (hb.gen, coordinator.node_heartbeat.remote(self.node, hb))
        return True

    def _said_enough(self, hb: Heartbeat, now: float, ram: Optional[tuple[int, int]]) -> bool:
        """A batch or metrics went within :attr:`quiet_s` and the heartbeat would add
        nothing (no late rank, no metrics held, no footprint due): it is skipped, so a node
        stepping at least once a second sends one message a step and no heartbeat."""
        return (now - self._spoke_at < self.quiet_s and not hb.late and not hb.metrics
                and ram is None)

    @property
    def quiet_s(self) -> float:
        """How long the store may say nothing before a heartbeat goes: a quarter of the
        job's heartbeat timeout (at least an interval). The coordinator names a node after
        the timeout of silence, so a live node's last word, never older than this plus one
        interval, stays well inside it; a frozen node is named as soon as before (the
        timeout and at most an interval after its last word)."""
        return max(self.interval_s, self.timeout_s / 4)

    @property
    def late_s(self) -> float:
        """A rank silent this long is named in the heartbeat (and its process sampled for
        CPU starvation); well inside the timeout, so no hung rank goes unnamed."""
        return min(LATE_BEATS * self.interval_s, self.timeout_s / 2)

    def detail(self) -> dict[int, tuple[float, int]]:
        """Every local rank's (age of its last sign of life, step): ``status --ranks``."""
        with self._cond:
            return self.agg.detail(self.clock())

    def _footprint_if_due(self) -> Optional[tuple[int, int]]:
        """(RAM held, budget) when the next heartbeat should carry them, else None: measured
        at most once per FOOTPRINT_EVERY_S (a beat that does not go drops it). A footprint
        that fails is left out: it must never stop the node's heartbeat."""
        now = self.clock()
        if self.footprint is None or now - self._ram_at < FOOTPRINT_EVERY_S:
            return None
        self._ram_at = now
        try:
            held, budget = self.footprint()
            return int(held), int(budget)
        except Exception:  # noqa: BLE001 - a report, not a sign of life
            return None

    def _net_of_starvation(self, hb: Heartbeat, now: float) -> dict[int, tuple[float, int]]:
        """``hb``'s late ranks' ages, each less what its process waited for a CPU since it
        went late (its process sampled once an interval while it stays late). The first
        time that saves a rank from the timeout in a generation, the job's events say so."""
        beats = dict(hb.late)
        for rank in [r for r in self._credits if r not in beats]:
            del self._credits[rank]  # it beat again
        for rank, (age, step) in hb.late.items():
            pid = self._pids.get(rank)
            if pid is None:
                continue
            sample = self.sample(pid)
            if sample is None:
                continue  # gone, or no /proc: judged by its heartbeat alone
            credit = self._credits.get(rank)
            if credit is None:
                self._credits[rank] = StarvationCredit(sample, now)
                continue
            credit.add(sample, now)
            net = net_silence(age, credit, self.timeout_s)
            beats[rank] = (net, step)
            if age > self.timeout_s >= net and (hb.gen, rank) not in self._excused:
                self._excused.add((hb.gen, rank))
                self.coordinator.log_event.remote("rank_starved", {
                    "gen": hb.gen, "rank": rank, "node": self.node, "pid": pid,
                    "silent_s": round(age, 3), "waited_for_cpu_s": round(credit.credit_s, 3)})
        return beats

    def _fence_if_refused(self) -> None:
        if self._beat is None:
            return
        gen, ref = self._beat
        try:
            taken = self.get(ref, 0.0)
        except TimeoutError:
            return  # not answered yet: looked at again at the next tick
        except Exception:  # noqa: BLE001 - a coordinator restarting: not a refusal
            taken = True
        self._beat = None
        if taken is False:
            self.floor = max(self.floor, gen + 1)
            self._cond.notify_all()

    def tick(self) -> None:
        """What the node does every interval: a group's batches that waited long enough for
        a member go (where it leads one), then its heartbeat if one is due. Never raises."""
        if self._closed.is_set():
            return
        try:
            self.relay.tick()
            self._settle_metrics()
            self.heartbeat_once()
        except Exception:  # noqa: BLE001 - a coordinator restarting: the next tick
            pass

    def _beat_loop(self) -> None:
        while not self._closed.wait(self.interval_s):
            self.tick()
