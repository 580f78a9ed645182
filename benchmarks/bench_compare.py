#!/usr/bin/env python
"""Side-by-side benchmark: ``memckpt bench compare`` from a checkout.

    python benchmarks/bench_compare.py [--parts stall,lost_work,recovery,scaling]
        [--sizes 100M,1G] [--recovery-sizes 1G] [--json PATH] [--plot PNG]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run from a checkout without installing: the package sits next to this directory.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memckpt.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["bench", "compare", *sys.argv[1:]]))
