"""The manifest of a persisted checkpoint, and the folder layout it lives in.

Layout under a tier's root::

    step-0000000100/rank-00000.shard     one shard file per rank (memckpt.format.shard format)
    step-0000000100/rank-00001.shard
    step-0000000100/manifest.json        written LAST: without it the folder is no checkpoint

or, in two-slot mode (constant space, InternEvo's snapshot checkpoints), the
folders ``slot-a/`` and ``slot-b/`` used in turn.

A manifest is JSON: step, world size, config fingerprint, placement, one entry
per rank (key, size, the shard's data checksum), memckpt version, creation time,
job name, and an xxh3 of all of that (``manifest_xxh3``) so a flipped byte in the
manifest itself is caught. :meth:`Manifest.from_json` trusts nothing: every
field is type-checked, every shard key must be a safe key inside the
checkpoint's own folder (no ``..``, no absolute path, no backslash), and ranks
must be ``0 .. world_size-1``, each exactly once.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import xxhash

from memckpt.persist.backend import check_key
from memckpt.errors import ManifestError, UnsafeKeyError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
SLOT_FOLDERS = ("slot-a", "slot-b")
STEP_FOLDER_RE = re.compile(r"^step-(\d{10})$")
SLOT_FOLDER_RE = re.compile(r"^slot-[ab]$")
SHARD_NAME_RE = re.compile(r"^rank-(\d{5})\.shard$")
MAX_MANIFEST_BYTES = 64 << 20
_HEX16 = re.compile(r"^[0-9a-f]{16}$")


def step_folder(step: int) -> str:
    """``step-0000000100`` for step 100."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10 ** 10:
        raise ManifestError(f"step {step!r} is invalid: use a whole number from 0 to 9999999999")
    return f"step-{step:010d}"


def shard_name(rank: int) -> str:
    """``rank-00003.shard`` for rank 3."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 10 ** 5:
        raise ManifestError(f"rank {rank!r} is invalid: use a whole number from 0 to 99999")
    return f"rank-{rank:05d}.shard"


def shard_key(folder: str, rank: int) -> str:
    return f"{folder}/{shard_name(rank)}"


def manifest_key(folder: str) -> str:
    return f"{folder}/{MANIFEST_NAME}"


def is_checkpoint_folder(name: str) -> bool:
    """True for folder names memckpt writes: ``step-NNNNNNNNNN`` or ``slot-a`` / ``slot-b``."""
    return bool(STEP_FOLDER_RE.match(name) or SLOT_FOLDER_RE.match(name))


@dataclass(frozen=True)
class ShardEntry:
    """One rank's shard in a checkpoint: ``key`` is relative to the tier's root
    (``step-0000000100/rank-00000.shard``), ``size`` its length in bytes and
    ``checksum`` the shard header's ``data_xxh3`` (the header has its own
    checksum inside the shard)."""

    rank: int
    key: str
    size: int
    checksum: str

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "key": self.key, "size": self.size, "checksum": self.checksum}


def _int(d: Mapping[str, Any], name: str, where: str, minimum: int = 0) -> int:
    v = d.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ManifestError(f"{where}: {name}={v!r} is not a whole number >= {minimum}")
    return v


def _str(d: Mapping[str, Any], name: str, where: str) -> str:
    v = d.get(name)
    if not isinstance(v, str):
        raise ManifestError(f"{where}: {name}={v!r} is not a string")
    return v


def _digest(body: Mapping[str, Any]) -> str:
    blob = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
    return xxhash.xxh3_64_hexdigest(blob)


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint: which shards make up which step. Immutable and validated."""

    step: int
    world_size: int
    fingerprint: str
    shards: tuple[ShardEntry, ...]
    placement: dict[str, Any] = field(default_factory=dict)
    memckpt_version: str = ""
    created_at: float = 0.0
    job: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(sorted(self.shards, key=lambda e: e.rank)))
        self.validate()

    @property
    def folder(self) -> str:
        """The folder holding the shards (``step-…`` or ``slot-a`` / ``slot-b``)."""
        return self.shards[0].key.split("/", 1)[0]

    @property
    def nbytes(self) -> int:
        return sum(e.size for e in self.shards)

    def shard(self, rank: int) -> ShardEntry:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ManifestError(f"rank {rank!r} is not in this checkpoint (ranks 0..{self.world_size - 1})")
        return self.shards[rank]

    def validate(self, source: str = "manifest", folder: Optional[str] = None) -> None:
        """Raise :class:`ManifestError` unless every field is well-typed and every path safe.

        ``folder``: the folder the manifest was found in; every shard key must lie
        directly inside it. Without it the keys must share one memckpt folder.
        """
        where = source
        d = {"step": self.step, "world_size": self.world_size}
        _int(d, "step", where)
        _int(d, "world_size", where, minimum=1)
        for name in ("fingerprint", "memckpt_version", "job"):
            if not isinstance(getattr(self, name), str):
                raise ManifestError(f"{where}: {name}={getattr(self, name)!r} is not a string")
        if not isinstance(self.placement, dict):
            raise ManifestError(f"{where}: placement={self.placement!r} is not an object")
        ca = self.created_at
        if isinstance(ca, bool) or not isinstance(ca, (int, float)) or not math.isfinite(ca):
            raise ManifestError(f"{where}: created_at={ca!r} is not a finite number")
        if not self.shards:
            raise ManifestError(f"{where}: lists no shards")
        if folder is None:
            folder = self.shards[0].key.split("/", 1)[0] if isinstance(self.shards[0].key, str) else ""
        if not is_checkpoint_folder(folder):
            raise ManifestError(f"{where}: folder {folder!r} is not a memckpt checkpoint folder "
                                "(step-NNNNNNNNNN, slot-a or slot-b)")
        m = STEP_FOLDER_RE.match(folder)
        if m and int(m.group(1)) != self.step:
            raise ManifestError(f"{where}: says step {self.step} but lies in folder {folder!r}")
        seen: set[int] = set()
        for e in self.shards:
            if not isinstance(e, ShardEntry):
                raise ManifestError(f"{where}: shard entry {e!r} is not a ShardEntry")
            ed = e.to_dict()
            rank = _int(ed, "rank", f"{where} shard entry")
            _int(ed, "size", f"{where} shard of rank {rank}", minimum=64)
            csum = _str(ed, "checksum", f"{where} shard of rank {rank}")
            if not _HEX16.match(csum):
                raise ManifestError(f"{where}: shard of rank {rank} has checksum {csum!r}, "
                                    "expected 16 hex digits (xxh3-64)")
            try:
                check_key(e.key, f"{where}: shard key of rank {rank}")
            except UnsafeKeyError as err:
                raise UnsafeKeyError(err.message + " (refusing this manifest)") from None
            if e.key.count("/") != 1 or not e.key.startswith(folder + "/"):
                raise UnsafeKeyError(f"{where}: shard key {e.key!r} of rank {rank} is not a file "
                                     f"directly inside the checkpoint's folder {folder!r} "
                                     "(refusing this manifest)")
            if rank >= self.world_size:
                raise ManifestError(f"{where}: rank {rank} is out of range for world size "
                                    f"{self.world_size} (ranks 0..{self.world_size - 1})")
            if rank in seen:
                raise ManifestError(f"{where}: rank {rank} is listed twice")
            seen.add(rank)
        if len(seen) != self.world_size:
            missing = sorted(set(range(self.world_size)) - seen)
            raise ManifestError(f"{where}: world size {self.world_size} but no shard for ranks "
                                f"{missing[:10]}{' ...' if len(missing) > 10 else ''}")

    # -- JSON -----------------------------------------------------------------------------------
    def _body(self) -> dict[str, Any]:
        return {
            "memckpt_manifest": MANIFEST_FORMAT, "step": self.step, "world_size": self.world_size,
            "fingerprint": self.fingerprint, "placement": self.placement,
            "shards": [e.to_dict() for e in self.shards], "memckpt_version": self.memckpt_version,
            "created_at": self.created_at, "job": self.job,
        }

    def to_json(self) -> str:
        body = self._body()
        try:
            digest = _digest(body)
        except (TypeError, ValueError) as e:
            raise ManifestError(f"manifest of step {self.step}: placement must be JSON-able: {e}") from None
        return json.dumps(dict(body, manifest_xxh3=digest), indent=1, sort_keys=True,
                          allow_nan=False) + "\n"

    @staticmethod
    def from_json(text: str | bytes, source: str, folder: Optional[str] = None) -> "Manifest":
        """Parse and validate a manifest read from ``source`` (named in every error).

        ``folder``: where it was found; shard keys must be files directly inside it.
        Raises :class:`ManifestError` (or :class:`UnsafeKeyError` for a path that
        would leave the folder) naming ``source`` and the offending field.
        """
        if isinstance(text, (bytes, bytearray, memoryview)):
            if len(text) > MAX_MANIFEST_BYTES:
                raise ManifestError(f"{source}: {len(text)} bytes is too large for a manifest")
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError:
                raise ManifestError(f"{source}: is not UTF-8 text") from None
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ManifestError(f"{source}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ManifestError(f"{source}: not a JSON object")
        if d.get("memckpt_manifest") != MANIFEST_FORMAT:
            raise ManifestError(f"{source}: memckpt_manifest={d.get('memckpt_manifest')!r}, this "
                                f"memckpt reads format {MANIFEST_FORMAT}")
        stored = d.pop("manifest_xxh3", None)
        try:
            digest = _digest(d)
        except (TypeError, ValueError):
            raise ManifestError(f"{source}: holds values that are not plain JSON") from None
        if stored != digest:
            raise ManifestError(f"{source}: manifest checksum mismatch (stored {stored!r}, computed "
                                f"{digest}): the manifest is corrupt")
        shards_raw = d.get("shards")
        if not isinstance(shards_raw, list):
            raise ManifestError(f"{source}: shards={shards_raw!r} is not a list")
        entries = []
        for row in shards_raw:
            if not isinstance(row, dict):
                raise ManifestError(f"{source}: shard entry {row!r} is not an object")
            rank = _int(row, "rank", f"{source} shard entry")
            entries.append(ShardEntry(rank=rank, key=_str(row, "key", f"{source} rank {rank}"),
                                      size=_int(row, "size", f"{source} rank {rank}", minimum=64),
                                      checksum=_str(row, "checksum", f"{source} rank {rank}")))
        created = d.get("created_at")
        placement = d.get("placement")
        if not isinstance(placement, dict):
            raise ManifestError(f"{source}: placement={placement!r} is not an object")
        fields = dict(step=_int(d, "step", source), world_size=_int(d, "world_size", source, 1),
                      fingerprint=_str(d, "fingerprint", source), placement=placement,
                      memckpt_version=_str(d, "memckpt_version", source), job=_str(d, "job", source))
        if isinstance(created, bool) or not isinstance(created, (int, float)):
            raise ManifestError(f"{source}: created_at={created!r} is not a number")
        # Build without __post_init__'s default validation, then validate with source/folder.
        m = object.__new__(Manifest)
        for k, v in dict(fields, shards=tuple(sorted(entries, key=lambda e: e.rank)),
                         created_at=float(created)).items():
            object.__setattr__(m, k, v)
        m.validate(source, folder)
        return m

    def describe_mismatch(self, world_size: Optional[int] = None,
                          fingerprint: Optional[str] = None) -> Optional[str]:
        """What differs between this checkpoint and a job (None if nothing that matters)."""
        diffs = []
        if world_size is not None and world_size != self.world_size:
            diffs.append(f"it was written by {self.world_size} ranks, this job has {world_size} "
                         "(world size differs: resume with the same number of workers)")
        if fingerprint is not None and fingerprint != self.fingerprint:
            diffs.append(f"its config fingerprint is {self.fingerprint}, this job's is {fingerprint} "
                         "(the model or the config that shapes the state changed)")
        return "; ".join(diffs) or None
