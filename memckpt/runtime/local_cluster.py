"""Deprecated alias, kept for one version: import ``LocalCluster`` and ``local_cluster`` from
:mod:`memckpt.testing` (their public home, which stays put while the runtime's modules move),
and start a held cluster with ``python -m memckpt.runtime.tools.local_cluster``. Every name
taken from here warns (``FutureWarning``), as ``memckpt.FailurePolicy`` does."""

from __future__ import annotations

import warnings
from typing import Any

NEW_HOME = "memckpt.testing"


def _moved(what: str) -> None:
    warnings.warn(f"memckpt.runtime.local_cluster is deprecated: {what} (this alias goes in the "
                  f"next version)", FutureWarning, stacklevel=3)


def __getattr__(name: str) -> Any:
    from memckpt.runtime.tools import local_cluster as moved
    value = getattr(moved, name)  # AttributeError: a name it never had
    _moved(f"import {name} from {NEW_HOME}" if name in ("LocalCluster", "local_cluster")
           else f"{name} is memckpt.runtime.tools.local_cluster.{name}")
    return value


if __name__ == "__main__":
    _moved("run python -m memckpt.runtime.tools.local_cluster")
    from memckpt.runtime.tools.local_cluster import main
    raise SystemExit(main())
