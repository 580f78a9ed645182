"""memckpt: fault-tolerant in-memory replica checkpointing for PyTorch training on Ray."""

from memckpt.checkpointer import Checkpointer
from memckpt.config import (ChaosEvent, Config, FailurePolicy, LoadSpec, PersistTier,
                            PlacementConfig, WorkersConfig, load_config)
from memckpt.data import ResumableSampler
from memckpt.errors import MemckptError
from memckpt.state import TrainState

__version__ = "0.1.0"

__all__ = [
    "Checkpointer", "ChaosEvent", "Config", "FailurePolicy", "LoadSpec", "MemckptError",
    "PersistTier", "PlacementConfig", "ResumableSampler", "TrainState", "WorkersConfig",
    "load_config", "__version__",
]
