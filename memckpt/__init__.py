"""memckpt: fault-tolerant in-memory replica checkpointing for PyTorch training on Ray."""

from memckpt.checkpointer import Checkpointer
from memckpt.config import (ChaosEvent, Config, FailurePolicy, LoadSpec, PersistTier,
                            PlacementConfig, WorkersConfig, load_config)
from memckpt.data import ResumableSampler
from memckpt.errors import MemckptError
from memckpt.faults import FaultInjector
from memckpt.state import TrainState


def run(train_fn, config, **kwargs):
    """Run ``train_fn(ctx)`` on Ray with in-memory replicas; see :func:`memckpt.runtime.run`."""
    from memckpt.runtime import run as _run
    return _run(train_fn, config, **kwargs)

__version__ = "0.1.0"

__all__ = [
    "Checkpointer", "ChaosEvent", "Config", "FailurePolicy", "FaultInjector", "LoadSpec", "MemckptError",
    "PersistTier", "PlacementConfig", "ResumableSampler", "TrainState", "WorkersConfig",
    "load_config", "run", "__version__",
]
