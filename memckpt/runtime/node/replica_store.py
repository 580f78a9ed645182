"""The replica store: one per node, holding snapshot shards in that node's RAM.

It keeps two kinds of shards, all in shared-memory files under
``<ram_root>/<job>/<node_id>/`` (the layout: :mod:`memckpt.runtime.wire.ram_files`):

* ``own/rank<r>/slot{0,1}.shard``: written by the node's own workers (their
  snapshot slots). They outlive a killed worker; the store only reads them.
* ``replicas/rank<r>/slot{0,1}.shard``: copies of peer ranks' shards, streamed
  by the owning worker over TCP straight into the file (:mod:`memckpt.runtime.wire.data_plane`),
  verified against their checksum before they are acknowledged. Bytes land in
  the store's own memory: an object put by a worker dies with the worker.

A replica's data chunks that the node already holds at the same step (DDP keeps
parameters identical on every rank, so a holder's own rank has the same bytes) are
copied locally instead of received: see :meth:`ReplicaStore.fill_local`.

Because everything lives in files, a restarted store process adopts what the
previous one held. Replica slots per rank: receiving step t overwrites the slot
already holding t, else the older slot; the runtime only sends t+1 once t is
committed, so the newest committed copy is never overwritten.
"""

from __future__ import annotations

import logging
import itertools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import numpy as np
import psutil
import xxhash

from memckpt.format import shard as fmt
from memckpt.engine.buffers import RamRegion, allocated_bytes, remove_path, resolve_ram_root
from memckpt.engine.shared_pages import open_slot, punch_zeros
from memckpt.policy.footprint import RamBudget, budget_bytes, human_bytes
from memckpt.runtime.node import replica_pages
from memckpt.runtime.node.shard_server import ShardServer
from memckpt.runtime.coordinator.messages import ReadyBatch
from memckpt.runtime.node.uplink import Uplink, View
from memckpt.runtime.ray_nodes import Whereabouts
from memckpt.runtime.wire.ram_files import (OWN, REPLICAS, find, held, invalidate, node_dir,
                                            peek_step, scan)
from memckpt.errors import (MemckptError, NoSnapshotError, PlacementError,
                            StaleGenerationError, SupersededPutError)

RAM_HEADROOM = 256 << 20  # keep this much RAM free for the node's other processes
# How long a holder waits for its own ranks to seal the step a replica arrives for (they
# finish the same step at about the same time) before it takes every byte over the wire.
FILL_WAIT_S = 0.25
FILL_POLL_S = 0.002
FILL_WAIT_BACKOFF = 20  # after a wait found nothing: puts of that rank that do not wait

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Freed:
    """What :meth:`ReplicaStore.keep_only` freed: the folders removed (``own/rank2``, ...)
    and their bytes."""

    removed: tuple[str, ...]
    freed_bytes: int


@dataclass
class _Put:
    """One transfer of ``rank``'s shard of ``step`` into ``path``, from :meth:`ReplicaStore.begin`
    to :meth:`ReplicaStore.finish`."""
    rank: int
    step: int
    gen: int
    path: Path
    region: RamRegion
    filled: Optional[tuple[fmt.Chunks, set[int]]] = None  # data chunks filled locally, checked
    # the chunk table of the complete shard this transfer overwrites (the rank's copy two
    # snapshots back), when its bytes stay where they are: its chunks that did not change
    # are left in place, neither sent nor copied
    prior: Optional[fmt.Chunks] = None
    prior_len: int = 0  # that shard's data length
    before: list[tuple[int, int]] = field(default_factory=list)  # its homes before the reset


class ReplicaStore:
    """Per-node holder of shards. Thread-safe; run as a threaded Ray actor."""

    def __init__(self, ram_root: str, job: str, node_id: str,
                 ram_budget: RamBudget = 0.5) -> None:
        """``ram_budget``: the job's ``Config.ram_budget`` (0.5, its default, where not
        given), what the footprint it reports is held against."""
        self.node_id = node_id
        self.ram_budget = ram_budget
        self.root = node_dir(resolve_ram_root(ram_root or None), job, node_id)
        self.own = self.root / OWN
        self.replicas = self.root / REPLICAS
        self.replicas.mkdir(parents=True, exist_ok=True)
        self.own.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        # transfers under way: by ticket, and which one is current for each (rank, step)
        self._open: dict[int, _Put] = {}
        self._current: dict[tuple[int, int], int] = {}
        self._tickets = itertools.count(1)
        self._fenced: set[int] = set()  # tickets of transfers a newer generation fenced off
        self.generation = -1  # writes from older generations of workers are refused
        self._server: Optional[ShardServer] = None
        # shard file -> (its identity: replica_pages.identity, its mapping)
        self._mapped: dict[Path, tuple[Optional[tuple[int, int]], RamRegion]] = {}
        # replica file -> the ranges its mapping takes from its partner's file (replica_pages)
        self._homes: dict[Path, list[tuple[int, int]]] = {}
        self._fill_backoff: dict[int, int] = {}  # rank -> puts left that skip the fill wait
        # the node's readiness, metrics, heartbeats (and every few seconds its footprint)
        self.uplink = Uplink(node_id, footprint=self.footprint)

    def set_generation(self, gen: int) -> None:
        """Fence off an older generation's in-flight replication (called during recovery)."""
        with self._lock:
            self.generation = max(self.generation, gen)
            for ticket, put in list(self._open.items()):
                if put.gen < self.generation:
                    del self._open[ticket]
                    self._current.pop((put.rank, put.step), None)
                    self._fenced.add(ticket)
        self.uplink.fence(gen)

    def _fence(self, gen: int) -> None:
        if gen < self.generation:
            raise StaleGenerationError(f"write from generation {gen} refused: the job is at "
                                       f"generation {self.generation}")

    def ping(self) -> Whereabouts:
        return Whereabouts(self.node_id, os.getpid())

    # -- the node's agent toward the coordinator (memckpt.runtime.node.uplink) --------------
    def join(self, rank: int, gen: int, ranks: list[int], coordinator: Any,
             interval_s: float, pid: Optional[int] = None,
             timeout_s: Optional[float] = None, holders: Optional[list[str]] = None,
             relay: Optional[tuple[list[str], Any]] = None) -> bool:
        """``rank`` (process ``pid``) of generation ``gen`` reports through this store;
        ``ranks``: every rank placement put on this node; the job's heartbeat interval and
        timeout; ``holders``: where its spec places its shards; ``relay``: the node's relay
        group (leader first) and the leader's store. False: ``gen`` is fenced off."""
        return gen >= self.generation and self.uplink.join(rank, gen, ranks, coordinator,
                                                            interval_s, pid, timeout_s, holders,
                                                            relay)

    def relay_ready(self, node: str, batch: ReadyBatch, timeout_s: float) -> Any:
        """A member's batch for this leader to merge (:mod:`memckpt.runtime.node.relay`):
        the coordinator's reference to the answer, or None (not its leader: it sends the
        batch itself). Called in the ``commit`` concurrency group."""
        return self.uplink.relay_ready(node, batch, timeout_s)

    def rank_detail(self) -> dict[int, tuple[float, int]]:
        """Each local rank's (seconds since its last sign of life, its step): the per-rank
        view the coordinator does not keep (``memckpt status --ranks``)."""
        return self.uplink.detail()

    def rank_ready(self, rank: int, gen: int, step: int, holders: list[str]) -> bool:
        """``rank``'s shard of ``step`` is placed (False: join first)."""
        return self.uplink.rank_ready(rank, gen, step, holders)

    def wait_commit(self, gen: int, step: int, timeout_s: float) -> Optional[View]:
        """The commit answer for ``step`` (None: none yet). Call it in the ``commit``
        concurrency group (``.options(concurrency_group="commit")``)."""
        return self.uplink.wait_commit(gen, step, timeout_s)

    def report(self, rank: int, gen: int, step: int, metrics: dict[str, float],
               snapshotted: bool) -> bool:
        return self.uplink.report(rank, gen, step, metrics, snapshotted)

    def beat(self, rank: int, gen: int, step: int) -> bool:
        return self.uplink.beat(rank, gen, step)

    def flush(self, gen: int, timeout_s: float) -> bool:
        """A rank's run ended: what this store holds of ``gen`` reaches the coordinator."""
        return self.uplink.flush(gen, timeout_s)

    # -- receiving replicas -----------------------------------------------------------------
    def _slot_for(self, rank: int, step: int) -> Path:
        rank_dir = self.replicas / f"rank{rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        paths = [rank_dir / n for n in fmt.SLOT_NAMES]
        steps = [peek_step(p) for p in paths]
        if step in steps:
            return paths[steps.index(step)]
        # Overwrite an empty/incomplete slot first, else the older one.
        order = sorted(range(len(paths)), key=lambda i: -1 if (s := steps[i]) is None else s)
        return paths[order[0]]

    def begin(self, rank: int, step: int, nbytes: int, checksum: str, gen: int = -1) -> int:
        """Prepare to receive ``rank``'s shard of ``step``: the transfer's ticket, which
        :meth:`receive`, :meth:`fill_local` and :meth:`finish` take; 0 if already held intact.

        A transfer of the same shard still open (its sender died or stalled mid-shard, its
        connection's thread not done yet) is superseded: every later call of it is refused,
        and its file is replaced by a fresh one, so bytes it still writes into its mapping
        (the rest of a piece under way) never land in this transfer's copy."""
        with self._lock:
            self._fence(gen)
            stale = self._open.pop(self._current.pop((rank, step), 0), None)
            if stale is not None:
                log.info("memckpt: a new transfer of rank %d's replica of step %d supersedes "
                         "one still open (its sender died or stalled mid-shard)", rank, step)
                self._mapped.pop(stale.path, None)
                self._homes.pop(stale.path, None)
                replica_pages.release(stale.path, self._mapping)
                remove_path(stale.path)
            path = self._slot_for(rank, step)
            if peek_step(path) == step:
                try:
                    region = RamRegion.open(path, populate=False)  # the header only
                    shard = fmt.open_shard(region.array, str(path), verify=False)
                    if shard.header["data_xxh3"] == checksum:
                        return False
                except MemckptError:
                    pass
            self._check_memory(rank, nbytes, path)
            prior, prior_len = self._prior(path, nbytes)
            invalidate(path)
            region = self._mapping(path, nbytes)
            fmt.mark_writing(region.array)
            before = self._homes.get(path, [])
            self._homes[path] = replica_pages.reset(region, path, before)
            self._mapped[path] = (replica_pages.identity(path), region)  # its record changed
            ticket = next(self._tickets)
            self._open[ticket] = _Put(rank, step, gen, path, region, prior=prior,
                                      prior_len=prior_len, before=before)
            self._current[(rank, step)] = ticket
            return ticket

    def _prior(self, path: Path, nbytes: int) -> tuple[Optional[fmt.Chunks], int]:
        """The chunk table and data length of the complete shard in ``path``, if a transfer
        of ``nbytes`` will overwrite it in place (same size: the file is reused, its bytes
        stay); (None, 0) otherwise. Its chunks were verified when it was received, and
        nothing has written to it since (this store is its only writer, and a transfer that
        stopped half way left it flagged incomplete: not read here)."""
        try:
            if peek_step(path) is None or path.stat().st_size != nbytes:
                return None, 0
            region = RamRegion.open(path, populate=False)  # the header only
            try:
                header, layout, cap = fmt.read_header(region.array, str(path))
            finally:
                region.close()
            return fmt.Chunks.of(header, fmt.data_offset(cap)), layout.data_len
        except (OSError, MemckptError):
            return None, 0

    def _put(self, ticket: int) -> _Put:
        """The open transfer ``ticket``, if still current and of a current generation."""
        with self._lock:
            put = self._open.get(ticket)
            if put is None:
                raise self._not_open(ticket)
            self._fence(put.gen)
            return put

    def _not_open(self, ticket: int) -> MemckptError:
        """Why transfer ``ticket`` is no longer accepted (call with the lock held)."""
        if ticket in self._fenced:
            return StaleGenerationError(f"replica transfer {ticket} refused: its generation is "
                                        f"older than the job's {self.generation}")
        return SupersededPutError(
            f"replica transfer {ticket} is not open on this store: never begun, finished, or "
            "superseded by a newer transfer of the same shard")

    def fill_local(self, ticket: int, chunks: fmt.Chunks) -> list[int]:
        """The data chunks of transfer ``ticket`` the sender need not send. First those the
        shard it overwrites (this rank's copy two snapshots back) holds unchanged at the
        same place: they stay as they are, neither sent, copied nor hashed again (a frozen
        tensor's chunks: a step's network bytes follow what changed). Then those a complete
        shard this node holds has with the same checksum (the rank's other replica slot,
        another rank's own slot at the step: DDP's parameters are identical on every rank),
        by a local copy, checksummed again before it counts (a source overwritten meanwhile
        is just sent); :meth:`finish` verifies the rest of the shard as always. Returns
        their indices. Never raises: a fill that fails only means more bytes on the wire."""
        try:
            put = self._put(ticket)
        except MemckptError:
            return []
        rank, step = put.rank, put.step
        filled: set[int] = set()
        try:
            dest = put.region.array
            data_len = len(dest) - chunks.data_offset
            prior = put.prior
            if prior is not None and (prior.data_offset, prior.chunk_bytes) == (
                    chunks.data_offset, chunks.chunk_bytes):
                for i, digest in enumerate(chunks.digests):
                    if (i < len(prior.digests) and prior.digests[i] == digest
                            and chunks.span(i, data_len) == prior.span(i, put.prior_len)):
                        filled.add(i)
            other = self._other_slot(put.path)
            filled = self._share(put, chunks, data_len, other, filled)
            for source in ([other] if other is not None else []) + self._fill_sources(rank, step):
                theirs = source.chunks
                if theirs is None or theirs.chunk_bytes != chunks.chunk_bytes:
                    continue
                src_len = source.layout.data_len
                for i, digest in enumerate(chunks.digests):
                    if i in filled or i >= len(theirs.digests) or theirs.digests[i] != digest:
                        continue
                    at, n = chunks.span(i, data_len)
                    src_at, src_n = theirs.span(i, src_len)
                    if n != src_n:
                        continue
                    np.copyto(dest[at: at + n], source.raw[src_at: src_at + n])
                    if xxhash.xxh3_64_hexdigest(memoryview(dest[at: at + n])) == digest:
                        filled.add(i)
        except (OSError, ValueError, MemckptError) as e:
            log.info("memckpt: filling rank %d's replica of step %d locally stopped: %s",
                     rank, step, e)
        put.filled = (chunks, filled)  # finish() need not hash them again
        return sorted(filled)

    def _share(self, put: _Put, chunks: fmt.Chunks, data_len: int,
               other: Optional[fmt.Shard], kept: set[int]) -> set[int]:
        """Map the chunks of ``put`` its complete partner ``other`` holds to the partner's
        pages and keep the ``kept`` ones in place (:func:`replica_pages.lay_out`); returns
        the chunks so filled. Laid out again as at :meth:`begin` if that fails half way,
        so that nothing received lands on a page the partner uses."""
        with self._lock:  # the mapping is this transfer's alone: laid out outside the lock
            homes = self._homes.get(put.path, [])
        try:
            filled, homes = replica_pages.lay_out(put.region, put.path, chunks, data_len,
                                                  other, kept, homes, put.before)
        except (OSError, MemckptError) as e:
            log.info("memckpt: sharing rank %d's replica pages failed: %s", put.rank, e)
            # whatever it remapped before it failed: every page back to its own file first
            filled, homes = set(), replica_pages.reset(put.region, put.path,
                                                       [(0, put.region.size)])
        with self._lock:
            self._homes[put.path] = homes
            self._mapped[put.path] = (replica_pages.identity(put.path), put.region)
        return filled

    def _other_slot(self, path: Path) -> Optional[fmt.Shard]:
        """The complete shard in the other slot of the replica ``path`` is a slot of
        (unverified: each chunk copied from it is checked)."""
        for other in (path.parent / name for name in fmt.SLOT_NAMES):
            if other == path or peek_step(other) is None:
                continue
            try:
                with self._lock:
                    array = self._mapping(other).array
                return fmt.open_shard(array, str(other), verify=False)
            except (OSError, MemckptError):
                return None
        return None

    def _fill_sources(self, rank: int, step: int) -> list[fmt.Shard]:
        """Complete shards of ``step`` on this node other than ``rank``'s (unverified: each
        copied chunk is checked), after waiting up to FILL_WAIT_S for this node's own ranks
        to seal ``step`` if they have not yet. A wait that finds nothing (an own rank that
        died, or snapshots at other steps) is not repeated for the next FILL_WAIT_BACKOFF
        puts of ``rank``."""
        deadline = time.monotonic() + FILL_WAIT_S
        may_wait = self._fill_backoff.get(rank, 0) == 0
        self._fill_backoff[rank] = max(0, self._fill_backoff.get(rank, 0) - 1)
        while may_wait:
            # peek_step reads a slot's prefix and header, never its data: cheap to poll
            newest = [max(steps) for steps in scan(self.own).values()]
            if not newest or min(newest) >= step:
                break  # every own rank has sealed the step (or there is none)
            if time.monotonic() > deadline:
                self._fill_backoff[rank] = FILL_WAIT_BACKOFF
                break
            time.sleep(FILL_POLL_S)
        paths = [p for r, s, p in held(self.root) if s == step and r != rank]
        out = []
        for path in paths:
            try:
                with self._lock:
                    array = self._mapping(path).array
                shard = fmt.open_shard(array, str(path), verify=False)
            except (OSError, MemckptError):
                continue  # overwritten meanwhile
            if shard.step == step:
                out.append(shard)
        return out

    def _mapping(self, path: Path, nbytes: Optional[int] = None) -> RamRegion:
        """The shard file at ``path`` mapped once and kept: mapping it afresh every step
        costs a page fault per 4 KiB (3x the copy itself, measured). With ``nbytes`` (a
        replica this store writes) the file is made that size if it is not; without, the
        file is only read (a worker's own slot, which this store must never replace)."""
        ino = replica_pages.identity(path)
        cached = self._mapped.get(path)
        if cached is not None and cached[0] == ino and nbytes in (None, cached[1].size):
            return cached[1]
        if nbytes:
            if cached is not None:  # resized: let the old mapping's pages go first
                self._mapped.pop(path)
                cached[1].close()
            region, self._homes[path] = replica_pages.open_for_write(path, nbytes, self._mapping)
            ino = replica_pages.identity(path)  # only this store writes its replica files
        else:  # the identity seen before mapping: a file replaced meanwhile (or sharing
            # other pages with its partner: a new sidecar) is remapped next time
            region = open_slot(path)
        self._mapped[path] = (ino, region)
        return region

    def _check_memory(self, rank: int, nbytes: int, path: Path) -> None:
        """Refuse, before a byte is allocated, ``rank``'s replica of ``nbytes`` into ``path``
        where the node lacks the RAM or it would take this node's memckpt files (its ranks'
        slots and the replicas it keeps: :meth:`footprint`) over ``ram_budget``: a node that
        only holds replicas checks its budget nowhere else. A file of the same size is
        reused (no new bytes), one of another size replaced (its bytes go back first)."""
        reuse = path.stat().st_size if path.exists() else 0
        need = max(0, nbytes - reuse)
        if not need:
            return
        avail = psutil.virtual_memory().available
        if avail - need < RAM_HEADROOM:
            raise PlacementError(
                f"node {self.node_id[:12]} lacks RAM for rank {rank}'s replica: needs "
                f"{need / 2**30:.2f} GiB more, {avail / 2**30:.2f} GiB available; lower "
                "placement.replicas, use fewer ranks per node, or add RAM")
        held, budget = self.footprint()
        if held + need > budget:
            raise PlacementError(
                f"node {self.node_id[:12]} refuses rank {rank}'s replica: memckpt's files hold "
                f"{human_bytes(held)} of host RAM there (its ranks' slots and the replicas it "
                f"keeps) and this replica needs {human_bytes(need)} more, "
                f"{human_bytes(held + need)} in all, more than ram_budget allows "
                f"({human_bytes(budget)}). Lower it with fewer copies (placement.replicas), "
                "fewer ranks per node (workers.workers_per_node), less state per rank (more "
                "ranks, ZeRO/FSDP sharding, snapshot less state), or raise Config.ram_budget "
                "(a fraction of the node's RAM, or bytes)")

    def write(self, ticket: int, offset: int, chunk: np.ndarray) -> int:
        """Copy one chunk of transfer ``ticket`` in (an in-process path; see :meth:`receive`)."""
        done = 0

        def fill(view: memoryview) -> None:
            nonlocal done
            np.frombuffer(view, dtype=np.uint8)[:] = chunk[done: done + len(view)]
            done += len(view)
        return self.receive(ticket, offset, len(chunk), fill)

    def receive(self, ticket: int, offset: int, nbytes: int,
                fill: Callable[[memoryview], None]) -> int:
        """Let ``fill`` write bytes ``offset .. offset+nbytes`` of transfer ``ticket`` straight
        into its file (a socket's ``recv_into``, or a copy). ``fill`` is called on
        consecutive parts of that range, in order. Refused once the transfer is superseded
        or fenced off (checked at every call: the server calls once per RECV_CHUNK)."""
        put = self._put(ticket)
        region = put.region
        if offset + nbytes > len(region.array):
            raise MemckptError(f"replica of rank {put.rank} step {put.step}: bytes "
                               f"{offset}..{offset + nbytes} exceed the announced {len(region.array)}")
        replica_pages.receive(region, offset, nbytes, fill)  # never listed while partial
        return nbytes

    def address(self, host: Optional[str] = None) -> tuple[str, int]:
        """Where workers stream shards to (:mod:`memckpt.runtime.node.shard_server`); started on first use."""
        with self._lock:
            if self._server is None:
                if host is None:
                    import ray
                    host = ray.util.get_node_ip_address()
                self._server = ShardServer(self, host)
            return self._server.address

    def finish(self, ticket: int) -> str:
        """Verify transfer ``ticket``'s shard and mark it complete; returns its checksum.
        The transfer is closed either way. It stays current while it is verified, so a
        transfer of the same shard begun meanwhile supersedes it (a fresh file) instead of
        writing into the slot this one is about to flag complete."""
        put = self._put(ticket)
        try:
            shard = fmt.accept_received(put.region.array,
                                        f"replica of rank {put.rank} step {put.step}", put.step,
                                        verified=put.filled)
            punch_zeros(put.region)  # the zeros received where the shard has no byte
        finally:
            with self._lock:
                closed = None if self._open.pop(ticket, None) else self._not_open(ticket)
                if self._current.get((put.rank, put.step)) == ticket:
                    del self._current[(put.rank, put.step)]
        if closed is not None:  # superseded or fenced off while it was verified
            raise closed
        return shard.header["data_xxh3"]

    # -- serving ----------------------------------------------------------------------------
    def inventory(self) -> dict[int, list[int]]:
        """rank -> steps held on this node (own slots and replicas), complete ones only."""
        out: dict[int, set[int]] = {}
        for rank, step, _ in held(self.root):
            out.setdefault(rank, set()).add(step)
        return {r: sorted(s) for r, s in out.items()}

    def largest_shard(self) -> Optional[tuple[int, list[list[Any]], int]]:
        """(file bytes, tensor table, data bytes) of the largest complete shard this node
        holds, own or replica: what a spare prepares a restore for (``Worker.prefault``)."""
        sized = []
        for _, _, path in held(self.root):
            try:
                sized.append((path.stat().st_size, path))
            except OSError:
                pass  # replaced meanwhile
        for size, path in sorted(sized, reverse=True):
            try:
                region = RamRegion.open(path, populate=False)
                try:
                    _, layout, _ = fmt.read_header(region.array, str(path), require_complete=False)
                finally:
                    region.close()
            except (OSError, MemckptError):
                continue  # overwritten meanwhile: the next largest
            return size, layout.to_json(), layout.data_len
        return None

    def locate(self, rank: int, step: int) -> Path:
        path = find(self.root, rank, step)
        if path is None:
            raise NoSnapshotError(f"node {self.node_id[:12]} holds no shard of rank {rank} at "
                                  f"step {step}")
        return path

    def read(self, rank: int, step: int) -> np.ndarray:
        """The verified bytes of ``rank``'s shard at ``step`` (a Ray call; restores stream
        them over :mod:`memckpt.runtime.node.shard_server` instead, see :meth:`serve_bytes`)."""
        path = self.locate(rank, step)
        return fmt.open_shard(self.serve_bytes(rank, step), str(path)).raw

    def serve_bytes(self, rank: int, step: int) -> np.ndarray:
        """``rank``'s shard file of ``step`` as held (complete by its prefix), unverified."""
        path = self.locate(rank, step)
        with self._lock:
            return self._mapping(path).array

    def discard_after(self, step: int) -> int:
        """Invalidate every held shard newer than ``step`` (after a rollback). Returns count."""
        n = 0
        for _, s, path in held(self.root):
            if s > step:
                invalidate(path)
                n += 1
        return n

    def keep_only(self, own: Iterable[int], replicas: Iterable[int]) -> Freed:
        """Free the shards of every rank this node no longer serves: the own slots of ranks
        not in ``own`` and the replicas of ranks not in ``replicas`` (a recovery moved ranks
        or resized the job; called once the new layout has committed a step, so no
        recovery reads the old layout again). Returns the folders removed (``own/rank2``,
        ...) and the bytes freed."""
        keep = {OWN: {int(r) for r in own}, REPLICAS: {int(r) for r in replicas}}
        removed, freed = [], 0
        with self._lock:
            for sub, ranks in keep.items():
                for rank_dir in sorted((self.root / sub).glob("rank*")):
                    try:
                        if int(rank_dir.name[4:]) in ranks:
                            continue
                    except ValueError:
                        continue
                    for f in rank_dir.iterdir():
                        freed += f.stat().st_size
                        self._mapped.pop(f, None)
                        self._homes.pop(f, None)
                    remove_path(rank_dir)
                    removed.append(f"{sub}/{rank_dir.name}")
        return Freed(tuple(removed), freed)

    def footprint(self) -> tuple[int, int]:
        """(bytes this job's memckpt files hold in this node's RAM: its ranks' slots and the
        replicas it keeps, as allocated pages; the budget ``ram_budget`` gives them here)."""
        return (allocated_bytes(self.root),
                budget_bytes(self.ram_budget, psutil.virtual_memory().total))

    def memory(self) -> dict[str, int]:
        used = sum(p.stat().st_size for p in self.root.rglob("*.shard"))
        return {"held_bytes": used, "available_bytes": psutil.virtual_memory().available}

    def clear(self) -> None:
        """Free everything this node holds for the job (the job finished, or a Ray Train
        job starts afresh: its uplink goes on)."""
        with self._lock:
            self._open.clear()
            self._current.clear()
            self._mapped.clear()
            self._homes.clear()
            if self._server is not None:
                self._server.close()
                self._server = None
        remove_path(self.root)
        try:  # the job's folder, once no other node's store (same machine) still uses it
            self.root.parent.rmdir()
        except OSError:
            pass
