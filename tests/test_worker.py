"""Worker-process helpers that need no cluster."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import traceback
import weakref

import pytest

from memckpt.errors import GenerationEnded
from memckpt.runtime.worker.worker import launcher_env, release_frames


class _Model:
    pass


def _train(registry: list) -> None:
    model = _Model()  # what a training function holds when recovery ends its generation
    registry.append(weakref.ref(model))
    try:
        raise KeyError("inner")
    except KeyError:
        raise GenerationEnded("generation 0 was ended by recovery")


def test_an_escaping_exception_no_longer_holds_the_training_state():
    """A survivor's previous model must be gone before the next generation restores (its
    pages are what the restore gets back), though the exception lives on in Ray."""
    refs: list = []
    with pytest.raises(GenerationEnded) as info:
        _train(refs)
    exc = info.value
    gc.collect()
    assert refs[0]() is not None  # the traceback's frame keeps the model alive
    lines = traceback.format_exception(exc)
    release_frames(exc)
    gc.collect()
    assert refs[0]() is None
    assert traceback.format_exception(exc) == lines  # same traceback, chained cause included


def test_settled_imports_are_frozen_and_later_garbage_is_still_collected():
    """After settle_imports (a worker process at start) the import-time objects are out of
    the collector's view, and a generation's state created later, held in a reference cycle
    as DDP's hooks hold a model, is still freed by the collection after it fails."""
    code = textwrap.dedent("""
        import gc, weakref
        import torch
        from memckpt.runtime.worker.worker import settle_imports
        settle_imports()
        frozen = gc.get_freeze_count()
        model = torch.nn.Linear(4, 4)
        model.me = [model]  # a cycle: only the collector frees it
        ref = weakref.ref(model)
        del model
        assert ref() is not None
        gc.collect()
        assert ref() is None, "a cycle made after settling was not collected"
        print(frozen)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) > 10_000  # torch's import-time objects, at least


def test_each_generation_gets_torchruns_variables_for_its_rank():
    """What accelerate and Lightning read to join the worker's process group."""
    env = launcher_env(2, 3, ("10.0.0.7", 29411))
    assert env == {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "GROUP_RANK": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29411"}


def test_a_survivor_forgets_accelerates_cached_rank():
    pytest.importorskip("accelerate")
    code = textwrap.dedent("""
        import os
        from accelerate.state import PartialState
        from memckpt.runtime.worker.worker import reset_framework_state
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="-1")
        assert PartialState(cpu=True).num_processes == 1
        reset_framework_state()
        assert PartialState._shared_state == {}
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
