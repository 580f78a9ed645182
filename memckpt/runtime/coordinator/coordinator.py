"""The coordinator: one named actor per job, holding membership and the commit of steps.

It knows no tensor bytes. Workers tell it when their shard of a step and its
replicas are in place (``shard_ready``); once every rank has, the step is
committed. It also takes heartbeats (a silent rank is *hung*), per-step metrics,
fire-once chaos claims and events, which it appends as JSON lines to
``<run_dir>/events.jsonl``. Per step it appends rank 0's loss to ``losses.jsonl``
and, once every rank has reported the step, each rank's snapshot stall to
``steps.jsonl`` (what ``memckpt report`` draws), and records the Ray metrics of
``memckpt.runtime.coordinator.metrics``.

It is no single point of failure: its small state is written to Ray's GCS
key-value store on every change, so when its process is killed Ray restarts it
(``max_restarts=-1``), it reloads that state, checks the committed step against
what the stores actually hold, and callers' retried calls carry on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional

from memckpt.persist.catalog import protect
from memckpt.runtime.coordinator.metrics import JobMetrics

COORDINATOR_NAMESPACE = "memckpt"


def coordinator_name(job: str) -> str:
    return f"memckpt-coordinator-{job}"


def _at_least(committed: Optional[int], step: int) -> bool:
    """``step`` is committed (step 0 counts: a falsy 0 once made every job's start wait out
    the full commit timeout)."""
    return committed is not None and committed >= step


def _kv():
    from ray.experimental import internal_kv
    return internal_kv


class Coordinator:
    """Run as an async Ray actor: ``ray.remote(Coordinator).options(name=..., ...)``."""

    def __init__(self, job: str, run_dir: str, world_size: int,
                 tiers: tuple = (), fingerprint: str = "") -> None:
        from memckpt.persist import CheckpointStore
        self.job = job
        self.fingerprint = fingerprint
        self.stores = [CheckpointStore(t) for t in tiers]  # persistence tiers, for manifests
        self._persist_shards: dict[tuple[int, int], dict[int, Any]] = {}  # (tier, step) -> entries
        self._folders: dict[tuple[int, int], str] = {}
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.world_size = world_size
        self._key = f"memckpt/{job}/coordinator".encode()
        self._cond = asyncio.Condition()
        self.heartbeats: dict[int, tuple[float, int]] = {}
        self.metrics: dict[str, dict[str, float]] = {}  # rank -> latest report (not persisted)
        self.losses: dict[str, float] = {}  # step -> loss, appended to losses.jsonl
        self._stalls: dict[int, dict[int, float]] = {}  # step -> rank -> stall_s, until complete
        self._pace: deque[tuple[float, int]] = deque(maxlen=64)  # rank 0's (time, step)
        self.job_metrics = JobMetrics(job)
        self.s: dict[str, Any] = {
            "gen": -1, "assignment": {}, "holders": {}, "committed": None, "ready": {},
            "workers": {}, "fired": [], "stores": {}, "stop": None, "persisted": {},
            "started_at": time.time(), "restarts_of_coordinator": 0, "done": False,
        }
        saved = _kv()._internal_kv_get(self._key)
        if saved:  # restarted after a crash: resume from the last saved view
            self.s = json.loads(saved)
            self.s["restarts_of_coordinator"] += 1
            self._reload_losses()
            protect(self.stores, self.s.get("protected", {}))
            self.event("coordinator_restarted", committed=self.s["committed"], gen=self.s["gen"])
            self._save()

    def _reload_losses(self) -> None:
        path = self.run_dir / "losses.jsonl"
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue  # a line torn by the crash
                self.losses[str(rec["step"])] = rec["loss"]

    # -- persistence of the small state -------------------------------------------------------
    def _save(self) -> None:
        _kv()._internal_kv_put(self._key, json.dumps(self.s).encode(), overwrite=True)

    def event(self, kind: str, **fields: Any) -> None:
        record = {"time": time.time(), "event": kind, **fields}
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps(record, default=str) + "\n")
        self.job_metrics.event(kind, fields)

    # -- membership ---------------------------------------------------------------------------
    async def configure(self, gen: int, assignment: dict[int, str], holders: dict[int, list[str]],
                        committed: Optional[int], stores: dict[str, str]) -> None:
        """Start generation ``gen`` of the worker group (driver, at start and after recovery)."""
        async with self._cond:
            self.world_size = len(assignment)  # an elastic job changes it between generations
            self.s.update(gen=gen, assignment={str(r): n for r, n in assignment.items()},
                          holders={str(r): list(h) for r, h in holders.items()},
                          committed=committed, ready={}, workers={}, stores=stores)
            self.heartbeats.clear()
            self.metrics.clear()
            self._stalls.clear()
            self._pace.clear()
            self._save()
            self._cond.notify_all()

    async def register(self, rank: int, gen: int, info: dict[str, Any]) -> None:
        if gen != self.s["gen"]:
            return
        self.s["workers"][str(rank)] = info
        self.heartbeats[rank] = (time.time(), -1)
        self._save()

    async def heartbeat(self, rank: int, gen: int, step: int) -> None:
        if gen == self.s["gen"]:
            self.heartbeats[rank] = (time.time(), step)

    # -- persistence ----------------------------------------------------------------------------
    async def request_stop(self, at_step: int, action: str) -> None:
        """Persist the first step committed at or after ``at_step`` to every tier; then the
        driver stops the job (action "stop") or goes on ("persist"). Decided at commit time,
        so every rank persists the same step while its snapshot is still in RAM."""
        self.s["stop"] = {"at": at_step, "action": action, "step": None}
        self.event("stop_requested", at=at_step, action=action)
        self._save()

    async def stop_state(self) -> Optional[dict[str, Any]]:
        return self.s.get("stop")

    async def clear_stop(self) -> None:
        self.s["stop"] = None
        self._save()

    async def persist_folder(self, tier: int, step: int) -> str:
        """The folder ``step`` goes into on ``tier``: decided once, the same for every rank."""
        key = (tier, step)
        if key not in self._folders:
            self._folders[key] = self.stores[tier].folder_for(step)
        return self._folders[key]

    async def persist_ready(self, tier: int, step: int, rank: int, entry: Any) -> bool:
        """``rank``'s shard of ``step`` is stored on ``tier``; the last one writes the manifest."""
        got = self._persist_shards.setdefault((tier, step), {})
        got[rank] = entry
        if len(got) < self.world_size:
            return False
        del self._persist_shards[(tier, step)]
        self._folders.pop((tier, step), None)
        store = self.stores[tier]
        t0 = time.time()
        store.commit(step, self.world_size, [got[r] for r in sorted(got)], self.fingerprint,
                     placement={"holders": self.s["holders"]}, job=self.job)
        self.s["persisted"][str(tier)] = step
        self._save()
        self.event("persisted", step=step, tier=store.describe(), manifest_s=time.time() - t0)
        return True

    async def started_over(self, gen: int, rank: int, step: int,
                           folders: dict[int, list[str]]) -> None:
        """``rank`` passed another model's persisted checkpoint over and starts at ``step``
        (load.on_incompatible="start_fresh"): the old model's step is no longer this job's
        committed one, and ``folders`` (per tier) are never written or removed.
        Every rank says so before it snapshots its start, so before this run commits."""
        async with self._cond:
            if gen != self.s["gen"]:
                return
            protect(self.stores, folders)
            saved = self.s.setdefault("protected", {})
            for tier, names in folders.items():
                saved[str(tier)] = sorted(set(saved.get(str(tier), [])) | set(names))
            if self.s["committed"] is not None:
                self.event("started_over", rank=rank, gen=gen, step=step,
                           old_committed=self.s["committed"])
                self.s["committed"] = None
            self._save()

    async def protected(self) -> dict[str, list[str]]:
        """The folders per tier no rank may write (see :meth:`started_over`)."""
        return dict(self.s.get("protected", {}))

    async def persisted(self) -> dict[str, int]:
        return dict(self.s["persisted"])

    async def hung(self, timeout_s: float, startup_timeout_s: float) -> list[int]:
        """Ranks of this generation whose last heartbeat is older than ``timeout_s``
        (``startup_timeout_s`` while a rank has not finished its first step: start-up
        imports, process-group rendezvous and restore may legitimately take longer)."""
        now = time.time()
        return sorted(r for r, (t, step) in self.heartbeats.items()
                      if now - t > (timeout_s if step >= 0 else startup_timeout_s))

    # -- commit -------------------------------------------------------------------------------
    def _commit_view(self) -> tuple[Optional[int], Optional[int], Optional[str]]:
        """(committed step, the committed step every rank must persist now or None, and
        what follows it: "stop" or "persist")."""
        stop = self.s.get("stop") or {}
        return self.s["committed"], stop.get("step"), stop.get("action")

    async def shard_ready(self, rank: int, gen: int, step: int,
                          holders: list[str]) -> tuple[Optional[int], Optional[int], Optional[str]]:
        """``rank``'s shard of ``step`` is local and on ``holders``; returns
        (committed step, step to persist now or None)."""
        async with self._cond:
            if gen != self.s["gen"]:
                return self._commit_view()
            need = set(self.s["holders"].get(str(rank), []))
            if not need <= set(holders):
                return self._commit_view()
            ready = self.s["ready"].setdefault(str(step), [])
            if rank not in ready:
                ready.append(rank)
            if len(ready) == self.world_size and (self.s["committed"] is None
                                                  or step > self.s["committed"]):
                self.s["committed"] = step
                stop = self.s.get("stop")
                if stop and stop["step"] is None and step >= stop["at"]:
                    stop["step"] = step
                for old in [k for k in self.s["ready"] if int(k) <= step]:
                    del self.s["ready"][old]
                self._cond.notify_all()
            self._save()
            return self._commit_view()

    async def wait_commit(self, gen: int, step: int,
                          timeout_s: float) -> tuple[Optional[int], Optional[int], Optional[str]]:
        """Wait until ``step`` is committed (or the generation changes, or time runs out)."""
        await self._until(lambda: self.s["gen"] != gen or _at_least(self.s["committed"], step),
                          timeout_s)
        return self._commit_view()

    async def _until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until ``predicate()`` holds (checked at every notify); False on timeout."""
        async with self._cond:
            try:
                await asyncio.wait_for(self._cond.wait_for(predicate), timeout_s)
                return True
            except asyncio.TimeoutError:
                return False

    async def committed(self) -> Optional[int]:
        return self.s["committed"]

    async def verify_committed(self, inventory: dict[str, dict[int, list[int]]]) -> Optional[int]:
        """Raise the committed step to what the stores prove: every rank's shard on its own
        node and on all its holders (used after a coordinator restart)."""
        async with self._cond:
            best = self.s["committed"]
            candidates = {s for held in inventory.values() for steps in held.values() for s in steps}
            for step in sorted(candidates, reverse=True):
                if best is not None and step <= best:
                    break
                ok = all(step in inventory.get(node, {}).get(int(r), []) and
                         all(step in inventory.get(h, {}).get(int(r), [])
                             for h in self.s["holders"].get(r, []))
                         for r, node in self.s["assignment"].items())
                if ok and len(self.s["assignment"]) == self.world_size:
                    best = step
                    break
            if best != self.s["committed"]:
                self.s["committed"] = best
                self.event("committed_rebuilt", committed=best)
                self._save()
                self._cond.notify_all()
            return best

    # -- progress, chaos, status --------------------------------------------------------------
    async def report(self, rank: int, gen: int, step: int, metrics: dict[str, float]) -> None:
        if gen != self.s["gen"]:
            return
        if "loss" in metrics and rank == 0:
            # A file, not the GCS: one small append per step, and it outlives this process.
            # After a rollback the redone steps are appended again; the last line wins.
            self.losses[str(step)] = metrics["loss"]
            with open(self.run_dir / "losses.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "loss": metrics["loss"], "gen": gen}) + "\n")
        now = time.time()
        self.metrics[str(rank)] = dict(metrics, step=step, time=now)
        self.heartbeats[rank] = (now, step)
        if rank == 0:
            self._pace.append((now, step))
        if "stall_s" in metrics:
            self._record_stall(rank, gen, step, metrics["stall_s"], now)
        self.job_metrics.step(rank, metrics)
        self.job_metrics.progress(self._newest_step(), self.s["committed"])

    def _record_stall(self, rank: int, gen: int, step: int, stall_s: float, now: float) -> None:
        """One line per step in steps.jsonl, once every rank reported it (ranks report in
        order, so an older step still incomplete then never will be: dropped)."""
        got = self._stalls.setdefault(step, {})
        got[rank] = stall_s
        if len(got) < self.world_size:
            return
        for old in [s for s in self._stalls if s <= step]:
            del self._stalls[old]
        with open(self.run_dir / "steps.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "gen": gen, "time": now,
                                "stall_s": [got[r] for r in sorted(got)]}) + "\n")

    def _newest_step(self) -> int:
        return max((int(m.get("step", -1)) for m in self.metrics.values()), default=-1)

    async def claim(self, key: str, standby_timeout_s: float = 0.0) -> bool:
        """Fire-once: True the first time ``key`` is claimed in this job. With a timeout, a
        steady fault: first wait (up to it) until the job is in standby (set_standby)."""
        if standby_timeout_s > 0 and key not in self.s["fired"]:
            # on timeout, fire anyway: a drill must not hang on a spare that never came
            await self._until(lambda: self.s.get("standby", False) or key in self.s["fired"],
                              standby_timeout_s)
        if key in self.s["fired"]:
            return False
        self.s["fired"].append(key)
        self.s.setdefault("fired_at", {})[key] = time.time()
        self._save()
        return True

    async def set_elastic(self, info: dict[str, Any]) -> None:
        """The driver: an elastic job's size, last resize and pending growth (for status)."""
        self.s["elastic"] = dict(self.s.get("elastic") or {}, **info)
        self._save()

    async def set_standby(self, ready: bool) -> None:
        """The driver: every node's warm spare is (or is no longer) ready to take over."""
        async with self._cond:
            self.s["standby"] = ready
            self._save()
            self._cond.notify_all()

    async def request_fault(self, key: str) -> None:
        """A rank reached a scheduled fault the driver must carry out (node, store, ...)."""
        async with self._cond:
            self.s.setdefault("fault_requests", {})[key] = "requested"
            self._save()

    async def pending_faults(self) -> list[str]:
        return [k for k, v in self.s.get("fault_requests", {}).items() if v == "requested"]

    async def fault_done(self, key: str) -> None:
        async with self._cond:
            self.s.setdefault("fault_requests", {})[key] = "done"
            self._save()
            self._cond.notify_all()

    async def wait_fault(self, key: str, timeout_s: float) -> None:
        await self._until(lambda: self.s.get("fault_requests", {}).get(key) == "done", timeout_s)

    async def log_event(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "failure_detected":  # where the job was: the start of what a resume redoes
            fields = dict(fields, reached_step=self._newest_step(), committed=self.s["committed"])
        self.event(kind, **fields)

    async def progress(self) -> dict[str, Any]:
        steps = [m.get("step", -1) for m in self.metrics.values()]
        newest = max(steps, default=-1)
        stalls = [m["stall_s"] for m in self.metrics.values() if "stall_s" in m]
        recent = [(t, s) for t, s in self._pace if t > time.time() - 5.0]  # the last 5 s
        rate = None
        if len(recent) > 1 and recent[-1][0] > recent[0][0]:
            rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        return {"gen": self.s["gen"], "committed": self.s["committed"],
                "min_step": min(steps) if len(steps) == self.world_size else -1,
                "max_step": newest, "last_loss": self.losses.get(str(newest)),
                "steps_per_s": rate,
                "stall_ms": max(stalls) * 1000 if stalls else None,
                "lag": newest - (self.s["committed"] or 0) if newest >= 0 else None}

    async def all_losses(self) -> dict[str, float]:
        return self.losses

    async def status(self) -> dict[str, Any]:
        return dict(self.s, metrics=self.metrics,
                    heartbeats={str(r): {"age_s": time.time() - t, "step": s}
                                for r, (t, s) in self.heartbeats.items()})

    async def whereabouts(self) -> dict[str, Any]:
        import os

        import ray
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id()}

    async def finish(self) -> None:
        self.s["done"] = True
        _kv()._internal_kv_del(self._key)
