#!/usr/bin/env python
"""Snapshot stall benchmark: ``memckpt bench snapshot`` from a checkout.

    python benchmarks/bench_snapshot.py [--sizes 100M,1G,4G] [--repeats N] [--json PATH]
                                        [--mode sync|overlap|both] [--dir DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: the package sits next to this directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memckpt.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "snapshot", *sys.argv[1:]]))
