"""When the driver prints its progress line (memckpt.policy.progress): pure, no Ray."""

from __future__ import annotations

from memckpt.policy.progress import MIN_INTERVAL_S, ProgressKey, progress_due


def test_first_step_prints_and_nothing_before_it():
    assert not progress_due(None, ProgressKey(0, -1, None), 10.0)
    assert progress_due(None, ProgressKey(0, 1, None), 10.0)


def test_a_slow_step_prints_once_however_long_it_takes():
    """A step longer than a second: the same line is not printed again every second."""
    last = ProgressKey(0, 1, 0)
    assert not any(progress_due(last, ProgressKey(0, 1, 0), t) for t in (1.0, 2.0, 30.0))


def test_step_commit_or_generation_change_prints():
    last = ProgressKey(0, 5, 4)
    for changed in (ProgressKey(0, 6, 4), ProgressKey(0, 5, 5), ProgressKey(1, 5, 4)):
        assert progress_due(last, changed, MIN_INTERVAL_S)


def test_fast_steps_print_at_most_once_a_second():
    last = ProgressKey(0, 5, 4)
    assert not progress_due(last, ProgressKey(0, 9, 8), MIN_INTERVAL_S - 0.01)
    assert progress_due(last, ProgressKey(0, 9, 8), MIN_INTERVAL_S)
