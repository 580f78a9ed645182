"""Helper module for the Hugging Face Trainer drills (not a test module): what a rank's
``trainer.train()`` under memckpt leaves to compare with an uninterrupted run. Shipped to the
workers by value with the job modules that use it (tests/_hf_ray_job.py, tests/_lora_job.py)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

VOLATILE = ("_runtime", "_per_second")  # wall-clock figures in the Trainer's log entries


def trainer_result(trainer: Any, hooks: Any, out: str, rank: int, **extra: Any) -> dict[str, Any]:
    """The Trainer's log without wall-clock figures, a hash of the final parameters and the
    step memckpt resumed from (and ``extra``), also written to ``<out>/rank<rank>.json``."""
    weights = hashlib.sha256()
    for name, tensor in trainer.model.state_dict().items():
        weights.update(name.encode())
        weights.update(tensor.detach().contiguous().numpy().tobytes())
    result = {"log_history": [{k: v for k, v in entry.items() if not k.endswith(VOLATILE)}
                              for entry in trainer.state.log_history],
              "weights": weights.hexdigest(), "resumed_from": hooks.restored_step, **extra}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    return result
