"""The persisted-checkpoint store of one tier: write shards, commit, find, read, retain.

    store = CheckpointStore(PersistTier("s3://bucket/ckpt", keep_last=2))
    entries = [store.write_shard(step, rank, shard_bytes) for rank, shard_bytes in ...]
    store.commit(step, world_size, entries, fingerprint=config.fingerprint())
    manifest, skipped = store.latest_valid(world_size=n, fingerprint=config.fingerprint())
    region = store.read_shard(manifest, rank)          # verified numpy uint8 array

Guarantees:

- **Manifest last.** ``write_shard`` first removes the target folder's
  manifest when there is one (a slot being reused; a committed step folder is
  rewritten only with ``replace=True``), so a folder being rewritten is never
  "complete" with a mix of old and new shards; then it stores the shard
  atomically. ``commit`` writes ``manifest.json`` only after every rank's
  shard was stored. A folder without a valid manifest is not a checkpoint for
  any reader.
- **Nothing corrupt is returned.** ``latest_valid(verify=True)`` and
  ``read_shard`` verify each shard (prefix, header checksum, data checksum,
  and that step, rank, world size, size and checksum match the manifest); a
  bad checkpoint is skipped for the next older one with a reason naming the
  step, the rank and the problem.
- **Retention only touches memckpt's own files.** After a commit, the job's
  complete checkpoints beyond the newest ``keep_last`` and partial folders
  older than the committed step are removed; the checkpoint just committed is
  never deleted, nor a checkpoint of another job or config sharing the root.
  Only folders named ``step-NNNNNNNNNN`` (or ``slot-a``/``slot-b``) are
  considered and inside them only ``manifest.json``, ``rank-NNNNN.shard`` and
  a local write's temporary files are deleted (manifest first). Any other file
  stays, and so does its folder.

Concurrency: several processes (one per rank) may call ``write_shard`` for the
same step at once; ``commit`` for a step must follow all of them, and commits
of one tier must be sequential (the next step's writes start after the
previous commit returned or was abandoned). In two-slot mode the slot is
chosen from the manifests present (the slot *not* holding the newest valid
manifest); pass the result of :meth:`folder_for` to every rank's
``write_shard(folder=...)`` to decide it once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

from memckpt.format import shard as fmt
from memckpt.config import PersistTier
from memckpt.errors import ChecksumError, ConfigError
from memckpt.persist.backend import Data, StorageBackend, as_bytes_view, partial_target
from memckpt.persist.deadline import DeadlineExceeded, call_within
from memckpt.errors import (
    ManifestError,
    ObjectNotFoundError,
    PersistError,
    UnsafeKeyError,
)
from memckpt.persist.manifest import (
    MANIFEST_NAME,
    SHARD_NAME_RE,
    SLOT_FOLDER_RE,
    SLOT_FOLDERS,
    STEP_FOLDER_RE,
    Manifest,
    ShardEntry,
    manifest_key,
    shard_key,
    step_folder,
)
from memckpt.persist.uri import open_backend
from memckpt.version import __version__

log = logging.getLogger("memckpt.persist")
_UNKNOWN = 10 ** 10  # sorts a folder of unknown step (a slot without manifest) as the newest


def _is_memckpt_file(name: str) -> bool:
    """manifest.json, rank-NNNNN.shard, or a local put's temporary file for one of them."""
    target = partial_target(name) or name
    return target == MANIFEST_NAME or bool(SHARD_NAME_RE.match(target))


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint folder as seen by a listing (shards are not read).

    ``complete``: a valid manifest is present and every shard it names is there
    with the size it records. ``reason`` says why not otherwise. ``step`` is None
    for a slot folder without a readable manifest (listed first: most likely a
    newer write that broke off). ``bytes``: the size of the
    memckpt files in the folder.
    """

    step: Optional[int]
    complete: bool
    reason: Optional[str]
    bytes: int
    folder: str
    manifest: Optional[Manifest] = None


class CheckpointStore:
    """Persisted checkpoints of one tier (a local directory or ``s3://bucket/prefix``).

    ``tier``: a :class:`~memckpt.config.PersistTier` (its ``keep_last``,
    ``two_slot`` and timeouts apply unless given here) or a URI string (the
    PersistTier defaults). ``backend``: use this backend instead of opening
    ``tier``'s URI (tests, custom S3 options).
    """

    def __init__(self, tier: PersistTier | str, keep_last: Optional[int] = None,
                 two_slot: Optional[bool] = None, *, backend: Optional[StorageBackend] = None,
                 **s3_options: Any) -> None:
        if isinstance(tier, PersistTier):
            uri = tier.uri
            keep_last = tier.keep_last if keep_last is None else keep_last
            two_slot = tier.two_slot if two_slot is None else two_slot
            timeouts: Any = tier
        elif isinstance(tier, str):
            uri, timeouts = tier, PersistTier  # the class attributes are the defaults
        else:
            raise ConfigError(f"CheckpointStore tier={tier!r} is invalid: pass a memckpt.PersistTier "
                              "or a URI string")
        keep_last = 2 if keep_last is None else keep_last
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ConfigError(f"keep_last={keep_last!r} is invalid: use a whole number >= 1 (the "
                              "newest complete checkpoint is never deleted)")
        self.uri = uri
        self.keep_last = keep_last
        self.two_slot = bool(two_slot)
        self.discover_timeout_s = float(timeouts.discover_timeout_s)
        self.close_timeout_s = float(timeouts.close_timeout_s)
        request_s = float(timeouts.request_timeout_s)
        s3_options.setdefault("read_timeout", request_s)
        s3_options.setdefault("connect_timeout", min(10.0, request_s))
        self.backend = backend if backend is not None else open_backend(uri, **s3_options)
        # folders of another model's checkpoints a job started fresh beside
        # (LoadSpec.on_incompatible="start_fresh"): never written, never removed by retention
        self.protected: set[str] = set()

    def describe(self) -> str:
        return self.backend.describe()

    def __repr__(self) -> str:
        mode = "two_slot" if self.two_slot else f"keep_last={self.keep_last}"
        return f"CheckpointStore({self.describe()!r}, {mode})"

    # -- writing ------------------------------------------------------------------------------
    def folder_for(self, step: int) -> str:
        """The folder ``step`` is written into: ``step-NNNNNNNNNN``, or in two-slot mode the slot
        that does not hold the newest valid manifest (``slot-a`` when neither does)."""
        step_folder(step)  # validates step
        if not self.two_slot:
            return step_folder(step)
        newest: tuple[int, str] | None = None
        for slot in SLOT_FOLDERS:
            m = self._read_manifest(slot)[0]
            if m is not None and (newest is None or m.step > newest[0]):
                newest = (m.step, slot)
        if newest is None:
            return SLOT_FOLDERS[0]
        return SLOT_FOLDERS[1] if newest[1] == SLOT_FOLDERS[0] else SLOT_FOLDERS[0]

    def is_committed(self, step: int) -> bool:
        """True if ``step`` has a valid manifest in this tier (shards are not read).

        A persister skips such a step (e.g. the newest committed step persisted
        again on SIGTERM) instead of rewriting it.
        """
        return self.committed(step) is not None

    def committed(self, step: int) -> Optional[Manifest]:
        """The valid manifest of ``step`` in this tier, or None (shards are not read)."""
        if not self.two_slot:
            return self._read_manifest(step_folder(step))[0]
        for slot in SLOT_FOLDERS:
            m = self._read_manifest(slot)[0]
            if m is not None and m.step == step:
                return m
        return None

    def write_shard(self, step: int, rank: int, data: Data, *, folder: Optional[str] = None,
                    verify: bool = True, replace: bool = False) -> ShardEntry:
        """Store rank ``rank``'s shard of ``step`` (the raw bytes of a sealed memckpt shard).

        Writes the shard atomically, after removing the folder's manifest if
        it has one (a slot being reused, or ``replace``). With ``verify`` the
        shard's checksums are checked before anything is written (a corrupt RAM
        copy is never persisted). ``data`` may be a larger slot: only the
        shard's own bytes are stored. Returns the entry to pass to :meth:`commit`.

        A step folder that already holds a committed manifest is not rewritten
        unless ``replace`` (rewriting removes its manifest: until the new commit
        that step is no checkpoint, so a kill in between loses it); the
        :class:`PersistError` says so. Check :meth:`is_committed` to skip instead.
        In two-slot mode the target slot is always the older one and is reused.
        """
        folder = self.folder_for(step) if folder is None else folder
        self._check_folder(folder, step)
        key = shard_key(folder, rank)
        region = np.frombuffer(as_bytes_view(data), dtype=np.uint8)
        source = f"rank {rank}'s shard of step {step}"
        h, layout, cap = fmt.read_header(region, source)
        size = fmt.data_offset(cap) + layout.data_len  # a slot may be larger than its shard
        if verify and fmt.data_digest(region[fmt.data_offset(cap): size], h) != h["data_xxh3"]:
            raise ChecksumError(f"{source}: data checksum mismatch: refusing to persist a corrupt shard")
        if int(h["step"]) != step:
            raise ChecksumError(f"rank {rank}'s shard holds step {h['step']}, not step {step}")
        if h.get("rank", rank) != rank:
            raise ChecksumError(f"the shard passed as rank {rank} of step {step} is rank {h.get('rank')}'s")
        # Invalidate first: from here on this folder is not a complete checkpoint.
        mkey = manifest_key(folder)
        if self.two_slot or replace:
            self.backend.delete(mkey)
        elif self.backend.exists(mkey):
            raise PersistError(f"step {step} is already committed in {self.describe()} "
                               f"({folder}): skip it, or pass replace=True to rewrite it (its "
                               "manifest is removed first, so until the new commit the step is "
                               "no checkpoint)", uri=self.describe())
        self.backend.put(key, region[:size])
        return ShardEntry(rank=rank, key=key, size=size, checksum=str(h["data_xxh3"]))

    def commit(self, step: int, world_size: int, entries: Sequence[ShardEntry], fingerprint: str,
               placement: Optional[dict[str, Any]] = None, job: str = "") -> Manifest:
        """Write ``step``'s manifest (last), then apply retention. Returns the manifest.

        ``entries``: what :meth:`write_shard` returned for every rank 0..world_size-1.
        Raises :class:`ManifestError` if a rank is missing or listed twice, or the
        entries lie in different folders. Retention failures are logged, not raised
        (the checkpoint is committed); see :meth:`apply_retention`.
        """
        entries = tuple(entries)
        folders = {e.key.split("/", 1)[0] for e in entries if isinstance(e, ShardEntry)}
        if len(folders) != 1:
            raise ManifestError(f"commit of step {step}: the shard entries lie in folders "
                                f"{sorted(folders)}; they must all be in one checkpoint folder")
        folder = folders.pop()
        self._check_folder(folder, step)
        manifest = Manifest(step=step, world_size=world_size, fingerprint=fingerprint,
                            shards=entries, placement=dict(placement or {}),
                            memckpt_version=__version__, created_at=time.time(), job=job)
        manifest.validate(f"commit of step {step}", folder)
        self.backend.put(manifest_key(folder), manifest.to_json().encode())
        log.info("memckpt: committed step %d (%d shards, %d bytes) to %s", step, world_size,
                 manifest.nbytes, self.describe())
        try:
            self.apply_retention(manifest)
        except PersistError as e:
            log.warning("memckpt: retention in %s failed (will retry after the next commit): %s",
                        self.describe(), e)
        return manifest

    def apply_retention(self, committed: Optional[Manifest] = None) -> list[str]:
        """Delete what retention allows; returns the folders it removed files from.

        ``committed``: the checkpoint just committed (default: the newest complete
        one). Among the step folders:

        - complete checkpoints of the same lineage (same job, fingerprint and
          world size as ``committed``) beyond the newest ``keep_last`` go;
          ``committed`` itself always stays. Checkpoints of another job or config
          sharing the root are never deleted.
        - folders without a complete checkpoint (no or invalid manifest, a shard
          file missing or of the wrong size) whose step is older than
          ``committed``'s are memckpt's broken writes and go; newer ones stay
          (they may be in progress).

        In ``committed``'s own folder, rank files and temporary files its manifest
        does not name (an earlier, larger world size; a crash) go too. Slots are
        never deleted (two-slot mode is constant space). Inside a folder only
        memckpt's files are deleted, the manifest first; other files, and so the
        folder, stay.
        """
        folders = self._folders()
        infos = self._infos(folders)
        touched: list[str] = []
        if committed is None:
            ref = next((i.manifest for i in infos if i.complete and i.manifest is not None
                        and (self.two_slot or STEP_FOLDER_RE.match(i.folder))), None)
        else:
            ref = committed
        if ref is None:
            return touched
        if ref.folder in folders:
            named = {e.key.split("/", 1)[1] for e in ref.shards} | {MANIFEST_NAME}
            stale = [f"{ref.folder}/{n}" for n in folders[ref.folder] if n not in named]
            if stale:
                self.backend.delete_many(stale)
                touched.append(ref.folder)
        if self.two_slot:
            return touched
        steps = [i for i in infos if i.step is not None and STEP_FOLDER_RE.match(i.folder)]
        lineage = [i for i in steps if i.complete and i.manifest is not None
                   and (i.manifest.job, i.manifest.fingerprint, i.manifest.world_size)
                   == (ref.job, ref.fingerprint, ref.world_size)]  # newest first
        doomed = [i for i in lineage[self.keep_last:] if i.folder != ref.folder]
        doomed += [i for i in steps if not i.complete and i.step is not None and i.step < ref.step]
        doomed = [i for i in doomed if i.folder not in self.protected]
        for info in doomed:
            self._delete_folder(info.folder, folders.get(info.folder, {}))
            touched.append(info.folder)
            log.info("memckpt: retention removed %s/%s (%s)", self.describe(), info.folder,
                     "complete, beyond keep_last" if info.complete else f"partial: {info.reason}")
        return touched

    def _delete_folder(self, folder: str, files: dict[str, int]) -> None:
        # The manifest goes first, on its own: a half-deleted folder is never "complete".
        if MANIFEST_NAME in files:
            self.backend.delete(manifest_key(folder))
        rest = [f"{folder}/{n}" for n in sorted(files) if n != MANIFEST_NAME]
        if rest:
            self.backend.delete_many(rest)

    def _check_folder(self, folder: str, step: int) -> None:
        if self.two_slot:
            if not SLOT_FOLDER_RE.match(folder):
                raise ManifestError(f"{self.describe()} is in two-slot mode: step {step} goes to "
                                    f"slot-a or slot-b, not {folder!r}")
        elif folder != step_folder(step):
            raise ManifestError(f"step {step} belongs in {step_folder(step)!r}, not {folder!r}")

    # -- listing ------------------------------------------------------------------------------
    def manifest_of(self, folder: str) -> Manifest:
        """The valid manifest of checkpoint ``folder`` (shards not read); :class:`PersistError`
        naming why there is none."""
        manifest, reason = self._read_manifest(folder)
        if manifest is None:
            raise PersistError(f"{self.describe()}/{folder} is no complete checkpoint: {reason}")
        return manifest

    def _read_manifest(self, folder: str) -> tuple[Optional[Manifest], Optional[str]]:
        key = manifest_key(folder)
        source = f"{self.describe()}/{key}"
        try:
            text = self.backend.get(key)
        except ObjectNotFoundError:
            return None, "no manifest.json (its write never finished, or it is being rewritten)"
        try:
            return Manifest.from_json(text.tobytes(), source, folder), None
        except (ManifestError, UnsafeKeyError) as e:
            return None, f"invalid manifest: {e.message}"

    def _folders(self) -> dict[str, dict[str, int]]:
        """memckpt folders at the top of the root -> {file name: size} of their memckpt files."""
        out: dict[str, dict[str, int]] = {}
        for key, size in self.backend.list_sizes("").items():
            parts = key.split("/")
            if len(parts) != 2 or not (STEP_FOLDER_RE.match(parts[0]) or SLOT_FOLDER_RE.match(parts[0])):
                continue
            if _is_memckpt_file(parts[1]):
                out.setdefault(parts[0], {})[parts[1]] = size
        return out

    def discover(self) -> list[CheckpointInfo]:
        """:meth:`list_checkpoints` within ``discover_timeout_s`` (what a job's start waits on).

        A retryable error (endpoint down, throttled) is tried again with backoff until
        the bound; then, or when the storage does not answer at all, a retryable
        :class:`PersistError` names the tier, its endpoint, what was tried and what to do.
        """
        t0 = time.monotonic()
        bound = self.discover_timeout_s
        tried = "listing the objects under it and reading each checkpoint's manifest.json"

        def listing() -> list[CheckpointInfo]:
            delay = 0.25
            while True:
                try:
                    return self.list_checkpoints()
                except PersistError as e:
                    if not e.retryable or time.monotonic() + delay - t0 >= bound:
                        raise
                    log.warning("memckpt: %s (retrying in %.2g s)", e.message, delay)
                    time.sleep(delay)
                    delay = min(2 * delay, 4.0)

        try:
            return call_within(listing, bound, f"{self.backend.location()} to list its checkpoints")
        except DeadlineExceeded:
            problem = f"did not answer within {bound:g} s ({tried})"
        except PersistError as e:
            if not e.retryable:
                raise
            problem = f"kept failing for {time.monotonic() - t0:.0f} s ({tried}): {e.message}"
        raise PersistError(f"{self.backend.location()} {problem}. {self._unreachable_fix()}",
                           retryable=True, uri=self.describe()) from None

    def _unreachable_fix(self) -> str:
        if self.uri.startswith("s3://"):
            check = ("check that the endpoint is up and reachable from this node (network, "
                     "firewall, proxy) and that AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 / "
                     "MEMCKPT_S3_ENDPOINT_URL names the right one")
        else:
            check = "check that its filesystem answers (a hung network mount?)"
        return (f"To go on: {check}; or remove this tier from Config.persistence to start "
                "without it; a slow but working store: raise its PersistTier.discover_timeout_s")

    def list_checkpoints(self) -> list[CheckpointInfo]:
        """Every memckpt checkpoint folder under the root, newest step first.

        Reads manifests, not shards: ``complete`` means a valid manifest whose
        shard files are all present with the recorded sizes. Both layouts
        (step folders and slots) are listed whatever this store's mode.
        """
        return self._infos(self._folders())

    def _infos(self, folders: dict[str, dict[str, int]]) -> list[CheckpointInfo]:
        infos = []
        for folder, files in folders.items():
            nbytes = sum(files.values())
            m = STEP_FOLDER_RE.match(folder)
            step = int(m.group(1)) if m else None
            if MANIFEST_NAME not in files:
                infos.append(CheckpointInfo(step, False, "no manifest.json (its write never "
                                            "finished, or it is being rewritten)", nbytes, folder))
                continue
            manifest, reason = self._read_manifest(folder)
            if manifest is None:
                infos.append(CheckpointInfo(step, False, reason, nbytes, folder))
                continue
            problem = None
            for e in manifest.shards:
                name = e.key.split("/", 1)[1]
                if name not in files:
                    problem = f"rank {e.rank}'s shard {e.key} is missing"
                elif files[name] != e.size:
                    problem = (f"rank {e.rank}'s shard {e.key} has {files[name]} bytes, the manifest "
                               f"records {e.size} (truncated or replaced)")
                if problem:
                    break
            infos.append(CheckpointInfo(manifest.step, problem is None, problem, nbytes, folder,
                                        manifest))
        # A slot without a readable manifest is most likely a newer write that broke off: first.
        infos.sort(key=lambda i: (i.step if i.step is not None else _UNKNOWN, i.complete), reverse=True)
        return infos

    # -- reading ------------------------------------------------------------------------------
    def _verify_shard(self, manifest: Manifest, rank: int) -> np.ndarray:
        """Read and verify one shard against its manifest; raise ChecksumError/PersistError."""
        e = manifest.shard(rank)
        source = f"{self.describe()}/{e.key}"
        region = self.backend.get(e.key)
        if len(region) != e.size:
            raise ChecksumError(f"{source}: {len(region)} bytes, the manifest records {e.size} "
                                "(truncated or replaced)")
        shard = fmt.open_shard(region, source, verify=True)
        h = shard.header
        if shard.step != manifest.step:
            raise ChecksumError(f"{source}: holds step {shard.step}, the manifest is step {manifest.step}")
        if h.get("rank", rank) != rank or h.get("world_size", manifest.world_size) != manifest.world_size:
            raise ChecksumError(f"{source}: is rank {h.get('rank')} of {h.get('world_size')}, the "
                                f"manifest expects rank {rank} of {manifest.world_size}")
        if h.get("data_xxh3") != e.checksum:
            raise ChecksumError(f"{source}: data checksum {h.get('data_xxh3')} differs from the "
                                f"manifest's {e.checksum} (the shard was replaced)")
        return region

    def read_shard(self, manifest: Manifest, rank: int) -> np.ndarray:
        """Rank ``rank``'s shard of ``manifest`` as a verified uint8 array (open it with
        :func:`memckpt.format.shard.open_shard`). Raises :class:`ChecksumError` if it is corrupt,
        truncated or not the shard the manifest names; :class:`PersistError` on I/O errors."""
        try:
            return self._verify_shard(manifest, rank)
        except ObjectNotFoundError:
            raise ChecksumError(f"{self.describe()}/{manifest.shard(rank).key}: rank {rank}'s shard "
                                f"of step {manifest.step} is missing") from None

    def check(self, manifest: Manifest) -> Optional[str]:
        """Read and verify every shard; None if all verify, else the first problem (step, rank, why).

        :class:`PersistError` for a retryable I/O error propagates (the checkpoint may be
        fine; the storage is not reachable right now).
        """
        for e in manifest.shards:
            try:
                self._verify_shard(manifest, e.rank)
            except ObjectNotFoundError:
                return f"step {manifest.step}, rank {e.rank}: shard {e.key} is missing"
            except ChecksumError as err:
                return f"step {manifest.step}, rank {e.rank}: {err.message}"
            except PersistError as err:
                if err.retryable:
                    raise
                return f"step {manifest.step}, rank {e.rank}: cannot read {e.key}: {err.message}"
        return None

    def latest_valid(self, world_size: Optional[int] = None, fingerprint: Optional[str] = None,
                     verify: bool = True) -> tuple[Optional[Manifest], list[str]]:
        """The newest checkpoint a job can resume from, and why newer ones were skipped.

        Candidates are visited newest first. Skipped (with a reason naming the
        step): a folder without a valid manifest, a missing or wrongly sized
        shard file, a different ``world_size`` or ``fingerprint`` (when given;
        the reason says what differs), and with ``verify`` a shard that fails
        verification (the reason names the rank and the problem). Returns
        ``(None, reasons)`` when nothing qualifies. Nothing is logged: the caller that
        acts on the answer reports the reasons (once).
        """
        return _search([self], world_size, fingerprint, verify, None)[1:]


def _search(stores: Sequence[CheckpointStore], world_size: Optional[int], fingerprint: Optional[str],
            verify: bool, below: Optional[int]
            ) -> tuple[Optional[CheckpointStore], Optional[Manifest], list[str]]:
    cands: list[tuple[int, int, CheckpointStore, CheckpointInfo]] = []
    reasons: list[str] = []
    many = len(stores) > 1
    for order, store in enumerate(stores):
        for info in store.discover():
            if below is not None and (info.step is None or info.step >= below):
                continue
            cands.append((info.step if info.step is not None else _UNKNOWN, -order, store, info))
    cands.sort(key=lambda c: (c[0], c[1]), reverse=True)
    for _, _, store, info in cands:
        where = f"{store.describe()}: " if many else ""
        label = f"step {info.step}" if info.step is not None else f"folder {info.folder}"
        if not info.complete or info.manifest is None:
            reasons.append(f"{where}{label} ({info.folder}) skipped: {info.reason}")
            continue
        m = info.manifest
        diff = m.describe_mismatch(world_size, fingerprint)
        if diff:
            reasons.append(f"{where}step {m.step} ({info.folder}) refused: {diff}")
            continue
        if verify:
            problem = store.check(m)
            if problem:
                reasons.append(f"{where}{problem} ({info.folder}); falling back to an older checkpoint")
                continue
        return store, m, reasons
    return None, None, reasons


def protect(stores: Sequence[CheckpointStore], folders: Mapping[Any, Iterable[str]]) -> None:
    """Leave ``folders`` (per tier index, an int or its string from JSON) untouched in
    ``stores``: never written, never removed by retention (another model's checkpoints a
    job started beside, ``load.on_incompatible="start_fresh"``)."""
    for tier, names in folders.items():
        stores[int(tier)].protected |= set(names)


def find_latest(stores: Sequence[CheckpointStore], world_size: Optional[int] = None,
                fingerprint: Optional[str] = None, verify: bool = True,
                below: Optional[int] = None
                ) -> tuple[Optional[CheckpointStore], Optional[Manifest], list[str]]:
    """The newest valid checkpoint across tiers: ``(store, manifest, skipped_reasons)``.

    All tiers' checkpoints are ordered by step (on a tie the earlier store in
    ``stores`` wins: list the fastest tier first) and verified newest first, so
    a slower tier is read only when it holds something newer or the faster one
    fails. Reasons are prefixed with the tier's URI. Nothing is logged: the caller
    reports the reasons. Listing a tier is bounded by its ``discover_timeout_s`` (see
    :meth:`CheckpointStore.discover`); reading the chosen shards is bounded per request
    by the tier's ``request_timeout_s``. ``below``: only checkpoints of an older step.
    """
    return _search(list(stores), world_size, fingerprint, verify, below)
