"""A snapshot slot: one shared-memory file holding one rank's shard of one step, and what
the engine knows of it (its mapping, layout, step, readers, and what it holds unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from memckpt.engine.buffers import RamRegion
from memckpt.engine.shared_pages import open_slot, sidecar
from memckpt.errors import ChecksumError, MemckptError
from memckpt.format import shard as fmt


@dataclass
class Slot:
    path: Path
    region: Optional[RamRegion] = None
    layout: Optional[fmt.Layout] = None
    header_capacity: int = 0
    step: Optional[int] = None  # step of the complete snapshot it holds
    complete: bool = False
    readers: int = 0
    views: dict[str, torch.Tensor] = field(default_factory=dict)
    # name -> the stamp (memckpt.engine.unchanged.stamp) of the tensor its bytes here were
    # copied from, and the chunk digests of this slot's last seal: a tensor unchanged since
    # is neither copied nor hashed again. Forgotten whenever the bytes may move.
    kept: dict[str, tuple] = field(default_factory=dict)
    digests: Optional[list[str]] = None
    # name -> the byte ranges of a watched tensor (memckpt.engine.write_watch) the kernel saw
    # written since this slot's copy of it was known to be its bytes: only they are compared
    suspect: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    dirty: list[tuple[int, int]] = field(default_factory=list)  # written by the snapshot under way
    # per data chunk, True where its pages live in the other slot's file (shared with it:
    # memckpt.engine.shared_pages); None: every chunk in this slot's own file
    away: Optional[list[bool]] = None
    laid: Any = None  # how its last snapshot shared its partner's pages (memckpt.engine.sharing)

    def forget(self) -> None:
        self.kept, self.digests, self.suspect = {}, None, {}

    def clear(self) -> None:
        """Unmap the slot and forget what it held (its file stays)."""
        self.release()
        self.layout, self.header_capacity, self.step, self.complete = None, 0, None, False
        self.forget()

    def release(self, unlink: bool = False) -> None:
        """Unmap the slot; ``unlink``: delete its file and sidecar too."""
        if unlink:
            sidecar(self.path).unlink(missing_ok=True)
        if self.region is not None:
            self.views = {}
            self.region.close(unlink=unlink)
            self.region = None
        elif unlink and self.path.exists():
            self.path.unlink()

    @property
    def mem(self) -> RamRegion:
        """The mapped region; only asked for once the slot was prepared or found."""
        assert self.region is not None, f"{self.path} is not mapped"
        return self.region

    @property
    def age(self) -> int:
        """The step held, -1 for none: newer snapshots compare greater."""
        return -1 if self.step is None else self.step


def read_slot(path: Path, populate: bool, pin: bool = False
               ) -> Optional[tuple[RamRegion, dict[str, Any], fmt.Layout, int]]:
    """A slot file's mapping (with the pages it shares with its partner:
    :func:`memckpt.engine.shared_pages.open_slot`), header, layout and header capacity; None
    when there is no file, or it is torn or foreign."""
    if not path.exists():
        return None
    try:
        region = open_slot(path, populate=populate, pin=pin)
        return (region, *fmt.read_header(region.array, str(path)))
    except MemckptError:
        return None


def newest_layout_in(directory: Path) -> Optional[fmt.Layout]:
    """The layout of the newest complete snapshot in ``directory``'s slots, from their
    headers alone (nothing populated): what a restore of it will create, known before an
    engine maps the slots."""
    newest: Optional[tuple[int, fmt.Layout]] = None
    for name in fmt.SLOT_NAMES:
        found = read_slot(Path(directory) / name, populate=False)
        if found is None:
            continue
        region, header, layout, _ = found
        region.close()
        if newest is None or int(header["step"]) > newest[0]:
            newest = (int(header["step"]), layout)
    return None if newest is None else newest[1]


def has_size(path: Path, nbytes: int) -> bool:
    try:
        return path.stat().st_size == nbytes
    except FileNotFoundError:
        return False


def verify_slot(path: Path) -> fmt.Shard:
    """Open and fully verify a slot or shard file (raises :class:`ChecksumError`)."""
    try:
        region = open_slot(path)
    except (OSError, MemckptError) as e:
        raise ChecksumError(f"{path}: cannot open ({e})") from None
    return fmt.open_shard(region.array, str(path), verify=True)
