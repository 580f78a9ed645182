"""Atomic file replacement: all of the new file or none of it, never a stray temporary."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from memckpt.util.fsutil import replace_atomic, write_atomic


def test_write_atomic_replaces_the_whole_file(tmp_path):
    path = tmp_path / "a" / "b" / "f.bin"
    write_atomic(path, b"old")
    data = np.arange(3 << 20, dtype=np.uint8)
    write_atomic(path, data)
    assert path.read_bytes() == data.tobytes()
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.bin"]


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(b"old")

    def half_then_fail(tmp):
        tmp.write_bytes(b"half")
        raise RuntimeError("disk gone")

    with pytest.raises(RuntimeError, match="disk gone"):
        replace_atomic(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]


def test_a_folder_removed_before_the_write_is_made_once_more(tmp_path):
    """Another process cleaning up empty folders (the persistence tier's retention) may
    remove the folder between its creation and the write: the write tries once more."""
    path = tmp_path / "step" / "f.bin"
    removed: list[int] = []

    def mkdirs_then_race(folder):
        folder.mkdir(parents=True, exist_ok=True)
        if not removed:
            removed.append(1)
            shutil.rmtree(folder)

    write_atomic(path, b"data", mkdirs=mkdirs_then_race)
    assert path.read_bytes() == b"data" and removed == [1]
