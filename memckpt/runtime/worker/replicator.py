"""A rank's replicator: each sealed snapshot streamed to the rank's replica holders over
TCP (:mod:`memckpt.runtime.wire.data_plane`), reported through the rank's node's store
(:mod:`memckpt.runtime.worker.node_link`), and marked committed once the coordinator says
every rank's copies are placed."""

from __future__ import annotations

import queue
import threading
import time
from functools import partial
from typing import Callable, Optional

from memckpt.format import shard as fmt
from memckpt.errors import ChecksumError, MemckptError
from memckpt.runtime.chaos.faults import fire
from memckpt.runtime.worker.node_link import NodeLink
from memckpt.runtime.worker.spec import WorkerSpec
from memckpt.runtime.worker.rank_checkpointer import RankCheckpointer
from memckpt.runtime.wire.data_plane import StoreConnection

RETRIES = 5  # tries per replica holder before the replication fails


class Replicator:
    """Background thread: sealed snapshot -> replica holders -> coordinator commit."""

    def __init__(self, spec: WorkerSpec, ckpt: RankCheckpointer, link: NodeLink) -> None:
        self.spec, self.ckpt, self.link = spec, ckpt, link
        self.queue: "queue.Queue[Optional[int]]" = queue.Queue()
        self.error: Optional[BaseException] = None
        self.bytes_sent = 0
        self.bytes_filled = 0  # replica bytes holders copied from their own node instead
        self.last_seconds = 0.0
        self.cancelled = False
        self.on_committed: Optional[Callable[[int, Optional[str]], None]] = None
        self._senders: dict[str, StoreConnection] = {}  # node id -> connection to its store
        self._thread = threading.Thread(target=self._loop, name="memckpt-replicator", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        import ray
        while True:
            step = self.queue.get()
            if step is None:
                return
            try:
                self._replicate(ray, step)
            except BaseException as e:  # surfaced on the training thread at the next step
                self.error = e
                return
            finally:
                self.queue.task_done()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued snapshot is replicated and committed."""
        deadline = time.time() + timeout_s
        while self.queue.unfinished_tasks and self.error is None:
            if time.time() > deadline:
                return False
            time.sleep(0.01)
        if self.error is not None:
            raise self.error
        return True

    def _replicate(self, ray, step: int) -> None:
        spec = self.spec
        t0 = time.perf_counter()
        with self.ckpt.read(step) as shard:
            for node in spec.holders:
                self._send(ray, node, step, shard)
        self.last_seconds = time.perf_counter() - t0
        view = self.link.ready(step, list(spec.holders), lambda: self.cancelled)
        if view is None:  # recovery ended this generation: no commit will come
            return
        _, persist, action = view
        self.ckpt.commit(step)
        if self.on_committed is not None:
            # Called before the next step can commit, so this step's slot is still in RAM.
            self.on_committed(step, action if persist == step else None)

    def _send(self, ray, node: str, step: int, shard: fmt.Shard) -> None:
        """Stream the shard to ``node``'s store over this rank's connection to it (but the
        chunks that store fills from its own node's copies)."""
        rank, store = self.spec.rank, self.spec.stores[node]
        for attempt in range(RETRIES):  # a restarting store comes back within seconds
            try:
                sender = self._senders.get(node)
                if sender is None:
                    sender = StoreConnection(ray.get(store.address.remote()))
                    self._senders[node] = sender
                sent = sender.send(rank, step, shard.raw, shard.header["data_xxh3"], self.spec.gen,
                                   lambda: self.cancelled, shard.chunks,
                                   stop_at=self._aimed(node, step))
                self.bytes_sent += sent
                self.bytes_filled += (len(shard.raw) - sent) if sent else 0  # 0: already held
                return
            except (OSError, ray.exceptions.RayActorError) as e:
                self._drop(node)
                if self.cancelled:
                    return
                last = e
                time.sleep(0.5 * (attempt + 1))
            except ChecksumError as e:  # corrupted on the way: send it again
                last = e
        raise MemckptError(f"rank {rank}: replica holder {node[:12]} unreachable for step {step} "
                           f"after {RETRIES} tries: {last}")

    def _aimed(self, node: str, step: int) -> Optional[tuple[int, Callable[[], None]]]:
        """A scheduled fault aimed at a byte of this rank's transfer of ``step`` to its first
        holder: (the byte, what fires it), for the connection to stop at."""
        for fault in self.spec.faults:
            if (fault.at_byte is not None and fault.at_step == step and fault.rank == self.spec.rank
                    and node == self.spec.holders[0]):
                return fault.at_byte, partial(fire, fault, self.spec.coordinator)
        return None

    def _drop(self, node: str) -> None:
        sender = self._senders.pop(node, None)
        if sender is not None:
            sender.close()

    def close(self) -> None:
        self.cancelled = True  # a stale generation must not keep writing to stores
        self.queue.put(None)
        for node in list(self._senders):
            self._drop(node)
