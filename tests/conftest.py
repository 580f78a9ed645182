"""Shared fixtures for the unit tests (no Ray)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest


def _shm_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def ram_root():
    """A fresh directory on the shared-memory tmpfs per test, removed afterwards."""
    path = tempfile.mkdtemp(prefix="memckpt-test-", dir=_shm_base())
    yield path
    shutil.rmtree(path, ignore_errors=True)
