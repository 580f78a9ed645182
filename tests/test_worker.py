"""Worker-process helpers that need no cluster."""

from __future__ import annotations

import gc
import traceback
import weakref

import pytest

from memckpt.errors import GenerationEnded
from memckpt.worker import release_frames


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
