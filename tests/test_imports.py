"""The processes that only move bytes and keep books never import torch."""

from __future__ import annotations

import subprocess
import sys

import memckpt


def test_store_coordinator_and_persistence_run_without_torch():
    # A replica store per node and the coordinator: importing torch would cost each 0.8 s of
    # CPU at every job start and ~0.25 GiB of RAM for as long as the job runs.
    code = ("import sys, memckpt, memckpt.runtime.node.replica_store, "
            "memckpt.runtime.coordinator.coordinator, "
            "memckpt.persist, memckpt.runtime.node.shard_server, memckpt.config; "
            "cfg = memckpt.Config(job_name='x'); "
            "sys.exit('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr or "torch was imported"


def test_the_public_names_resolve():
    for name in memckpt.__all__:
        assert getattr(memckpt, name) is not None, name
    assert memckpt.TrainState.__module__ == "memckpt.format.state"


def test_the_command_line_starts_without_torch():
    # `memckpt --help`, `status`, `kill`, `checkpoints ls`: one line back in about a second,
    # not after the 3-4 s torch takes to import (the benchmarks import it when they run)
    code = ("import sys\nfrom memckpt.cli import main\ntry:\n    main(['--help'])\n"
            "except SystemExit:\n    pass\nsys.exit('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr or "torch was imported"
