"""memckpt: fault-tolerant in-memory replica checkpointing for PyTorch training on Ray."""

import os as _os
import typing as _typing
from importlib import import_module as _import_module
from typing import Any as _Any, Callable as _Callable, ContextManager as _ContextManager

from memckpt import config as _config
from memckpt.config import (ChaosEvent, Config, ControlConfig, EngineConfig, FailureConfig, LoadSpec,
                            PersistTier, PlacementConfig, WorkersConfig, load_config)
from memckpt.errors import MemckptError
from memckpt.version import __version__

if _typing.TYPE_CHECKING:  # what the lazily loaded names are, for type checkers and IDEs
    from memckpt.checkpointer import Checkpointer
    from memckpt.format.data import ResumableSampler
    from memckpt.format.dcp_reader import MemckptReader
    from memckpt.format.state import TrainState
    from memckpt.runtime.chaos.faults import FaultInjector
    from memckpt.runtime.worker.context import WorkerContext

# Imported on first use: they need torch, which the replica stores and the coordinator
# (processes that only move bytes and keep books) never import (0.8 s and ~0.25 GiB each).
# WorkerContext needs Ray as well.
_LAZY = {"Checkpointer": "memckpt.checkpointer", "ResumableSampler": "memckpt.format.data",
         "TrainState": "memckpt.format.state", "WorkerContext": "memckpt.runtime.worker.worker"}


def __getattr__(name: str) -> _Any:
    if name in _config.RENAMED:
        return _config.renamed(name)
    if name in _LAZY:
        value = getattr(_import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'memckpt' has no attribute {name!r}")


def dcp_reader(uri_or_path: str | _os.PathLike[str], step: int | None = None) -> "MemckptReader":
    """A ``torch.distributed.checkpoint`` StorageReader over the newest (or ``step``'s)
    memckpt checkpoint under a local directory or ``s3://bucket/prefix``; see
    :mod:`memckpt.format.dcp_reader` for the names it gives each tensor."""
    from memckpt.persist.dcp_source import open_reader
    return open_reader(uri_or_path, step)


def keep_workers() -> _ContextManager[None]:
    """A block whose ``memckpt.run`` calls hand their worker processes on to the next
    one instead of starting new ones; see :mod:`memckpt.runtime.driver.kept`."""
    from memckpt.runtime.driver.kept import keep_workers as _keep
    return _keep()


def run(train_fn: _Callable[["WorkerContext"], _Any], config: Config, *, address: str | None = None,
        summary: str | _os.PathLike[str] | None = None, run_dir: str | _os.PathLike[str] | None = None,
        injector: "FaultInjector | None" = None, quiet: bool = False) -> dict[str, _Any]:
    """Run ``train_fn(ctx)`` on Ray with in-memory replicas; see :func:`memckpt.runtime.driver.driver.run`."""
    from memckpt.runtime.driver.driver import run as _run
    return _run(train_fn, config, address=address, summary=summary, run_dir=run_dir,
                injector=injector, quiet=quiet)

__all__ = [
    "Checkpointer", "ChaosEvent", "Config", "ControlConfig", "EngineConfig", "FailureConfig",
    "LoadSpec", "MemckptError",
    "PersistTier", "PlacementConfig", "ResumableSampler", "TrainState", "WorkerContext",
    "WorkersConfig", "dcp_reader",
    "keep_workers", "load_config", "run", "__version__",
]
