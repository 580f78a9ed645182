"""The driver's failure decisions and state machine, without Ray (memckpt.policy.failure)."""

from __future__ import annotations

import pytest

from memckpt.errors import (FallBehindError, MemckptError, MemoryBudgetError, RecoveryError,
                            StateError)
from memckpt.policy.failure import (ERROR_SETTLE_S, Action, Decision, Observation, State,
                                     decide, is_peer_failure, next_state)

SETTLED = ERROR_SETTLE_S + 0.1
PEER_LOST = RuntimeError("[gloo] Connection closed by peer [10.0.0.2]:4242")
USER_BUG = ValueError("shapes (3,) and (4,) do not match")


def obs(**fields) -> Observation:
    return Observation(**{"pending": (0, 1), "max_restarts": 3, **fields})


def test_every_rank_returned_finishes():
    assert decide(obs(pending=())) == Decision(Action.FINISH)


def test_ranks_still_running_wait():
    assert decide(obs()) == Decision(Action.WAIT)


def test_a_dead_actor_recovers_killing_only_that_rank():
    d = decide(obs(pending=(1,), died=(0,)))
    assert d.action is Action.RECOVER and d.died == (0,) and d.hung == ()
    assert d.what == "rank 0's worker died"


def test_a_dead_actor_outranks_everything_else_seen_at_once():
    d = decide(obs(died=(1,), unloadable=(0, "x"), hung=(0,), stop_persisted=4,
                   errors=((0, USER_BUG),), error_age_s=SETTLED))
    assert d.action is Action.RECOVER and d.died == (1,)


def test_an_unloadable_training_function_raises_naming_the_fix():
    d = decide(obs(unloadable=(1, "ModuleNotFoundError: No module named 'job'")))
    assert d.action is Action.RAISE and isinstance(d.error, MemckptError)
    msg = str(d.error)
    assert "rank 1's worker could not load the training function" in msg
    assert "No module named 'job'" in msg and "--working-dir" in msg


def test_a_persisted_stop_request_stops_at_once():
    d = decide(obs(stop_persisted=6, hung=(1,)))
    assert d == Decision(Action.STOP, step=6)


def test_hung_ranks_recover_and_are_killed_by_signal():
    d = decide(obs(hung=(1, 0)))
    assert d.action is Action.RECOVER and d.died == (1, 0) and d.hung == (1, 0)
    assert "stopped heart-beating (hung)" in d.what


def test_a_dead_standby_holder_recovers_with_no_rank_killed():
    d = decide(obs(lost_holders=("abcdef0123456789ffff",)))
    assert d.action is Action.RECOVER and d.died == () and "abcdef012345" in d.what
    assert "abcdef0123456789ffff" not in d.what


def test_a_fresh_error_waits_for_a_peer_death_to_explain_it():
    d = decide(obs(pending=(1,), errors=((0, PEER_LOST),), error_age_s=ERROR_SETTLE_S / 2))
    assert d == Decision(Action.WAIT)


def test_a_settled_error_first_probes_the_ranks_still_running():
    d = decide(obs(pending=(1,), errors=((0, USER_BUG),), error_age_s=SETTLED))
    assert d == Decision(Action.WAIT, probe=True)


def test_an_error_with_no_rank_left_is_decided_at_once_without_a_probe():
    d = decide(obs(pending=(), errors=((0, USER_BUG),), error_age_s=0.0))
    assert d.action is Action.RAISE and d.error is USER_BUG


def test_unreachable_ranks_explain_the_error_and_recover():
    d = decide(obs(pending=(1, 2), errors=((0, USER_BUG),), error_age_s=SETTLED,
                   unreachable=(2, 1)))
    assert d.action is Action.RECOVER and d.died == (1, 2)
    assert d.what == "rank(s) [1, 2] unreachable"


def test_a_terminal_memckpt_error_raises_as_is():
    err = StateError("the state changed shape")
    d = decide(obs(pending=(1,), errors=((0, err),), error_age_s=SETTLED, unreachable=()))
    assert d.action is Action.RAISE and d.error is err


def test_a_retryable_memckpt_error_recovers_only_when_a_peer_is_to_blame():
    peer = FallBehindError("rank 0: replica holder unreachable: connection reset by peer")
    own = FallBehindError("rank 0: the snapshot fell behind")
    assert peer.retryable and own.retryable
    assert decide(obs(pending=(), errors=((0, peer),))).action is Action.RECOVER
    assert decide(obs(pending=(), errors=((0, own),))) == Decision(Action.RAISE, error=own)


def test_a_collective_that_lost_its_peer_recovers():
    d = decide(obs(pending=(1,), errors=((0, PEER_LOST),), error_age_s=SETTLED, unreachable=()))
    assert d.action is Action.RECOVER and d.died == ()
    assert d.what == f"rank 0 lost a peer: {PEER_LOST}"


def test_a_bug_in_user_code_raises_the_user_error():
    d = decide(obs(pending=(1,), errors=((0, USER_BUG),), error_age_s=SETTLED, unreachable=()))
    assert d.action is Action.RAISE and d.error is USER_BUG


def test_the_lowest_rank_error_decides():
    d = decide(obs(pending=(), errors=((3, PEER_LOST), (1, USER_BUG))))
    assert d.error is USER_BUG
    other = KeyError("w")
    assert decide(obs(pending=(), errors=((2, other), (1, USER_BUG)))).error is USER_BUG


def test_the_error_that_failed_the_others_collectives_decides_whatever_its_rank():
    """Rank 2 raised; ranks 0 and 1 only saw their collective fail with it. Acting on
    rank 0's "lost a peer" would retry a job that fails the same way each time."""
    d = decide(obs(pending=(), errors=((0, PEER_LOST), (1, PEER_LOST), (2, USER_BUG))))
    assert d.action is Action.RAISE and d.error is USER_BUG
    over = MemoryBudgetError("node n2 holds 9 GiB of an 8 GiB ram_budget")
    d = decide(obs(pending=(), errors=((0, USER_BUG), (1, PEER_LOST), (2, over))))
    assert d.action is Action.RAISE and d.error is over  # not retryable: it stops the job
    d = decide(obs(pending=(), errors=((0, PEER_LOST), (2, PEER_LOST))))
    assert d.action is Action.RECOVER and d.what.startswith("rank 0 lost a peer")


@pytest.mark.parametrize("text, peer", [
    ("Connection reset by peer", True), ("Broken pipe", True), ("NCCL error", True),
    ("operation timed out", True), ("socket closed", True), ("KeyError: 'w'", False)])
def test_peer_failures_are_told_from_user_errors(text, peer):
    assert is_peer_failure(RuntimeError(text)) is peer


def test_a_rank_that_stopped_ends_the_job_once_the_others_follow():
    assert decide(obs(pending=(1,), stopped=8)) == Decision(Action.STOP, step=8, grace=True)
    # a peer failing in a collective with the stopped rank is expected, not a failure
    assert decide(obs(pending=(), stopped=8, errors=((1, PEER_LOST),))) == \
        Decision(Action.STOP, step=8, grace=True)
    assert decide(obs(pending=(), stopped=8)) == Decision(Action.STOP, step=8)


def test_recovering_past_max_restarts_gives_up_naming_the_setting():
    d = decide(obs(died=(0,), restarts=3, max_restarts=3))
    assert d.action is Action.RAISE and isinstance(d.error, RecoveryError)
    assert "gave up after 3 recoveries (failure.max_restarts)" in str(d.error)
    assert "last failure: rank 0's worker died" in str(d.error)
    assert d.what == "rank 0's worker died" and d.died == (0,)  # still reported as detected
    assert decide(obs(died=(0,), restarts=2, max_restarts=3)).action is Action.RECOVER
    assert decide(obs(died=(0,), max_restarts=0)).action is Action.RAISE


def test_max_restarts_applies_only_to_recoveries():
    assert decide(obs(pending=(), restarts=5, max_restarts=0)) == Decision(Action.FINISH)
    assert decide(obs(stop_persisted=2, restarts=5, max_restarts=0)).action is Action.STOP
    d = decide(obs(pending=(), errors=((0, USER_BUG),), restarts=5, max_restarts=0))
    assert d.error is USER_BUG and d.what == ""  # not a failure memckpt recovers from


def test_states_say_whether_they_are_terminal():
    assert [s for s in State if s.terminal] == [State.FINISHED, State.FAILED]


@pytest.mark.parametrize("action, state", [
    (Action.WAIT, State.RUNNING), (Action.FINISH, State.FINISHED), (Action.STOP, State.FINISHED),
    (Action.RECOVER, State.RECOVERING), (Action.RAISE, State.FAILED)])
def test_running_moves_on_by_the_decision(action, state):
    assert next_state(State.RUNNING, Decision(action)) is state


def test_a_recovery_starts_the_next_generation():
    path, state = [], State.STARTING
    for decision in (None, Decision(Action.RECOVER), None, None, Decision(Action.FINISH)):
        state = next_state(state, decision)
        path.append(state)
    assert path == [State.RUNNING, State.RECOVERING, State.STARTING, State.RUNNING,
                    State.FINISHED]


def test_nothing_follows_a_terminal_state_and_running_needs_a_decision():
    for terminal in (State.FINISHED, State.FAILED):
        with pytest.raises(ValueError, match="terminal"):
            next_state(terminal, Decision(Action.WAIT))
    with pytest.raises(ValueError, match="decision"):
        next_state(State.RUNNING)


# ---- several deaths, and deaths during a recovery (issue 26) -------------------------------

def test_two_ranks_dead_at_once_recover_together():
    d = decide(obs(pending=(1,), died=(2, 0)))
    assert d.action is Action.RECOVER and d.died == (0, 2)
    assert d.what == "ranks [0, 2]' workers died"


def test_a_death_reported_mid_plan_recovers_again_with_every_dead_rank():
    # rank 0 died while running; the plan phase then found rank 2 dead too: the driver
    # reports both (every death known so far), the decision is to recover from both
    d = decide(obs(pending=(), died=(0, 2), during="plan", restarts=1))
    assert d.action is Action.RECOVER and d.died == (0, 2)
    assert "during the recovery's plan phase" in d.what
    assert next_state(State.RECOVERING, d) is State.RECOVERING  # plan again, not start


def test_a_death_while_starting_the_next_generation_goes_back_to_recovering():
    d = decide(obs(pending=(), died=(1,), during="start", restarts=1))
    assert d.action is Action.RECOVER and "start phase" in d.what
    assert next_state(State.STARTING, d) is State.RECOVERING


def test_every_rank_dead_at_once_is_one_recovery_of_all_of_them():
    d = decide(obs(pending=(), died=(0, 1, 2)))
    assert d.action is Action.RECOVER and d.died == (0, 1, 2) and d.hung == ()


def test_a_hung_rank_stays_hung_when_more_deaths_are_reported():
    d = decide(obs(pending=(), died=(1, 2), hung=(2,), during="stop"))
    assert d.died == (1, 2) and d.hung == (2,)  # rank 2 still gets its SIGKILL


def test_a_death_during_a_recovery_still_counts_against_max_restarts():
    d = decide(obs(pending=(), died=(0,), during="restore", restarts=3))
    assert d.action is Action.RAISE and "failure.max_restarts" in str(d.error)
    assert "restore phase" in str(d.error)
    assert next_state(State.STARTING, d) is State.FAILED


def test_a_death_during_a_recovery_decides_recover_or_raise_only():
    with pytest.raises(ValueError, match="recover or raise"):
        next_state(State.RECOVERING, Decision(Action.FINISH))
    with pytest.raises(ValueError, match="during"):
        decide(obs(died=(0,), during="lunch"))
