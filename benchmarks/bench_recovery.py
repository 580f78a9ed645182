#!/usr/bin/env python
"""Recovery benchmark: ``memckpt bench recovery`` from a checkout.

    python benchmarks/bench_recovery.py [--state-mb 1024] [--repeats 3] [--json PATH]
                                        [--dir DIR] [--gpt-steps N] [--kill-at STEP]

Starts its own local Ray cluster (3 simulated nodes x 2 CPUs on this machine) and
shuts it down at the end; see memckpt/bench/recovery/ for what is measured.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: the package sits next to this directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memckpt.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "recovery", *sys.argv[1:]]))
