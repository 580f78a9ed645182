"""Where a job's shards lie in a node's shared memory, as its replica store and its workers
both read them: everything under ``<ram_root>/<job>/<node_id>/``.

* ``own/rank<r>/slot{0,1}.shard``: the snapshot slots of the node's own ranks, written by
  their workers; they outlive a killed worker.
* ``replicas/rank<r>/slot{0,1}.shard``: the copies of peer ranks' shards the node's store
  keeps (:mod:`memckpt.runtime.node.replica_store`).

A slot file is trusted only when complete: its prefix says so and its header's checksum
holds (:func:`peek_step`); :func:`invalidate` takes that back in place.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Iterator, Optional

import xxhash

from memckpt.format import shard as fmt

OWN = "own"  # the node's own ranks' slots
REPLICAS = "replicas"  # the copies of peer ranks' shards the node's store keeps


def node_dir(ram_root: Path, job: str, node_id: str) -> Path:
    return Path(ram_root) / job / node_id


def own_dir(ram_root: Path, job: str, node_id: str) -> Path:
    """Directory whose ``rank<r>`` subfolders hold the node's own workers' slots."""
    return node_dir(ram_root, job, node_id) / OWN


def scan(directory: Path) -> dict[int, dict[int, Path]]:
    """rank -> step -> slot file, for every complete shard under ``directory/rank*``."""
    out: dict[int, dict[int, Path]] = {}
    if not directory.is_dir():
        return out
    for rank_dir in directory.glob("rank*"):
        try:
            rank = int(rank_dir.name[4:])
        except ValueError:
            continue
        for name in fmt.SLOT_NAMES:
            step = peek_step(rank_dir / name)
            if step is not None:
                out.setdefault(rank, {})[step] = rank_dir / name
    return out


def held(node_root: Path) -> Iterator[tuple[int, int, Path]]:
    """(rank, step, file) of every complete shard a node holds: its own ranks' slots
    (``own/``) and the replicas placement gave it (``replicas/``)."""
    for sub in (OWN, REPLICAS):
        for rank, steps in scan(node_root / sub).items():
            for step, path in steps.items():
                yield rank, step, path


def find(node_root: Path, rank: int, step: int) -> Optional[Path]:
    """The file holding ``rank``'s shard of ``step`` on this node, if any."""
    return next((p for r, s, p in held(node_root) if (r, s) == (rank, step)), None)


def peek_step(path: Path) -> Optional[int]:
    """Step of a complete shard file (prefix and header checksum checked; data not, and the
    header's JSON not parsed: stores call this for every file on every put)."""
    try:
        with open(path, "rb") as f:
            head = f.read(fmt.PREFIX.size)
            if len(head) < fmt.PREFIX.size:
                return None
            magic, version, state, cap, hlen, hsum, off, _, step = fmt.PREFIX.unpack(head)
            if (magic != fmt.MAGIC or version not in fmt.READ_VERSIONS or state != fmt.STATE_COMPLETE
                    or hlen > cap or off != fmt.PREFIX.size + cap):
                return None
            blob = f.read(hlen)
        return step if len(blob) == hlen and xxhash.xxh3_64_intdigest(blob) == hsum else None
    except OSError:
        return None


def invalidate(path: Path) -> None:
    """Flag a slot file incomplete in place (the bytes stay, no reader trusts them)."""
    try:
        with open(path, "r+b") as f:
            f.seek(fmt.STATE_OFFSET)
            f.write(struct.pack("<I", fmt.STATE_WRITING))
    except FileNotFoundError:
        pass
