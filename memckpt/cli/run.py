"""``memckpt run TRAIN --config CONFIG.py``: load the training function and run it."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable

from memckpt.config import load_config
from memckpt.errors import ConfigError


def load_train_fn(spec: str) -> Callable[..., Any]:
    """``module:function`` or ``path/to/file.py:function`` -> the function."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ConfigError(f"TRAIN={spec!r} is invalid: write module:function or path/to/file.py:function")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"TRAIN={spec!r} is invalid: {target} does not exist")
        mod_name = f"memckpt_user_{path.stem}"
        mspec = importlib.util.spec_from_file_location(mod_name, path)
        assert mspec is not None and mspec.loader is not None  # a .py file that exists
        module = importlib.util.module_from_spec(mspec)
        sys.modules[mod_name] = module
        mspec.loader.exec_module(module)
        import ray.cloudpickle as cloudpickle  # workers cannot import a file path: ship it by value
        cloudpickle.register_pickle_by_value(module)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as e:
            raise ConfigError(f"TRAIN={spec!r} is invalid: cannot import {target} ({e}); run from "
                              "the directory that holds it or pass a path ending in .py") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ConfigError(f"TRAIN={spec!r} is invalid: {target} has no function {name!r}")
    return fn


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("train", metavar="TRAIN", help="module:function or path/to/file.py:function")
    parser.add_argument("--config", required=True, metavar="CONFIG.py",
                        help="a Python file defining config = memckpt.Config(...)")
    parser.add_argument("--address", default=None,
                        help="Ray cluster address (default: RAY_ADDRESS, else a local instance)")
    parser.add_argument("--summary", metavar="PATH", help="write the run summary JSON here")
    parser.add_argument("--run-dir", metavar="DIR", help="events and summary (default runs/JOB)")


def main(args: argparse.Namespace) -> int:
    from memckpt.runtime.driver.driver import run
    from memckpt.runtime.tools.job_client import probe
    config = load_config(args.config)
    fn = load_train_fn(args.train)
    probe(args.address)  # a cluster that is not there: one line now, not minutes of retries
    result = run(fn, config, address=args.address, summary=args.summary, run_dir=args.run_dir)
    print(json.dumps({"steps": result["steps"], "final_digest": result["final_digest"],
                      "recoveries": len(result["recoveries"])}))
    return 0
