"""What the driver decides about a running generation, as pure code.

The driver observes (which ranks returned, raised or died, who stopped heart-beating,
whether a stop was asked for) and acts (kill, recover, raise, stop); :func:`decide` is the
step between: an :class:`Observation` in, a :class:`Decision` out, nothing else touched.
:func:`next_state` is the driver's state machine. Neither imports Ray or torch, so both
are unit-tested without a cluster (tests/test_failure_decisions.py).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Optional, Sequence

from memckpt.errors import MemckptError, RecoveryError

ERROR_SETTLE_S = 0.5  # a raised error waits this long for a peer's death to explain it
# where a recovery can be when another death shows: ending the generation, planning,
# starting the next one, its ranks restoring (until the first step after the restored one)
RECOVERY_PHASES = ("stop", "plan", "start", "restore")


class Action(enum.Enum):
    WAIT = "wait"  # nothing to act on yet: keep watching
    FINISH = "finish"  # every rank returned
    STOP = "stop"  # a requested stop step is persisted: end the job cleanly
    RECOVER = "recover"  # a rank or node is gone: start the next generation from RAM copies
    RAISE = "raise"  # the job cannot go on: raise ``Decision.error``


@dataclass(frozen=True)
class Observation:
    """What the driver saw of one generation since it started (times in seconds)."""

    pending: tuple[int, ...]  # ranks still running
    died: tuple[int, ...] = ()  # ranks whose actor died (its process or node is gone)
    unloadable: Optional[tuple[int, str]] = None  # (rank, why): train_fn did not unpickle
    errors: tuple[tuple[int, BaseException], ...] = ()  # (rank, what its train_fn raised)
    error_age_s: float = 0.0  # since the first of ``errors``
    hung: tuple[int, ...] = ()  # running ranks that stopped heart-beating
    # nodes whose store stopped reporting (frozen or cut off): their ranks are in ``hung``
    silent_nodes: tuple[str, ...] = ()
    lost_holders: tuple[str, ...] = ()  # dead replica holder nodes that run no rank
    unreachable: Optional[tuple[int, ...]] = None  # pending ranks not answering; None: unasked
    stopped: Optional[int] = None  # a rank returned after persisting this requested stop step
    stop_persisted: Optional[int] = None  # the driver's stop request persisted at this step
    restarts: int = 0  # recoveries so far
    grow_to: Optional[int] = None  # elastic: the ranks stopped at a step boundary to grow to this
    max_restarts: int = 0  # failure.max_restarts
    # the recovery phase the deaths were seen in (see RECOVERY_PHASES); None: while running.
    # ``died`` then holds every rank known dead since the recovery began, not only the new
    during: Optional[str] = None


@dataclass(frozen=True)
class Decision:
    action: Action
    what: str = ""  # RECOVER (or RAISE, giving up on one): the failure, in words
    died: tuple[int, ...] = ()  # RECOVER: ranks to kill before recovering
    hung: tuple[int, ...] = ()  # RECOVER: ranks stopped by a signal (they ignore polite kills)
    silent_nodes: tuple[str, ...] = ()  # RECOVER: nodes that stopped reporting (frozen, cut off)
    error: Optional[BaseException] = None  # RAISE
    step: Optional[int] = None  # STOP: the persisted step
    grace: bool = False  # STOP: let running ranks end (briefly) before stopping
    probe: bool = False  # WAIT: ask the pending ranks whether they are alive, then decide again
    grow_to: Optional[int] = None  # RECOVER: not a failure, a resize to more ranks


def unloadable_error(rank: int, why: str) -> MemckptError:
    return MemckptError(
        f"rank {rank}'s worker could not load the training function: {why}. Make its module "
        "importable on every node: submit with `ray job submit --working-dir .`, install it "
        "as a package, or define it in the script that calls memckpt.run")


def is_peer_failure(err: BaseException) -> bool:
    """A collective failed because a peer went away (gloo/nccl), not a bug in user code."""
    text = f"{type(err).__name__}: {err}".lower()
    return any(s in text for s in ("connection closed", "connection reset", "broken pipe",
                                   "gloo", "nccl", "timed out", "peer", "socket"))


def decide(obs: Observation) -> Decision:
    """The driver's next move; checks run in the order the monitor has always used."""
    decision = _classify(obs)
    if decision.action is Action.STOP and obs.grow_to is not None:
        # the ranks stopped at the step boundary the driver asked for: restart larger
        return Decision(Action.RECOVER, f"nodes with room appeared: growing to {obs.grow_to} "
                        "ranks", grow_to=obs.grow_to)
    if decision.action is Action.RECOVER and obs.restarts >= obs.max_restarts:
        # the failure is still reported (``what``) before the job gives up
        return dataclasses.replace(decision, action=Action.RAISE, error=RecoveryError(
            f"gave up after {obs.max_restarts} recoveries (failure.max_restarts); "
            f"last failure: {decision.what}"))
    return decision


def died_what(died: tuple[int, ...], during: Optional[str] = None) -> str:
    """The failure, in words, for one or several dead ranks (and the phase they died in)."""
    ranks = sorted(set(died))
    what = (f"rank {ranks[0]}'s worker died" if len(ranks) == 1
            else f"ranks {ranks}' workers died")
    return what if during is None else f"{what} (during the recovery's {during} phase)"


def hung_what(hung: list[int], silent_nodes: tuple[str, ...]) -> str:
    """Hung ranks, in words: a node that stopped reporting is named as such (frozen or cut
    off: its store went silent with its ranks), the other ranks as hung."""
    if not silent_nodes:
        return f"rank(s) {hung} stopped heart-beating (hung)"
    nodes = ", ".join(n[:12] for n in silent_nodes)
    what = (f"node {nodes} stopped reporting (frozen or cut off)" if len(silent_nodes) == 1
            else f"nodes {nodes} stopped reporting (frozen or cut off)")
    return f"{what}: rank(s) {hung} lost"


def _root_cause(errors: Sequence[tuple[int, BaseException]]) -> tuple[int, BaseException]:
    """The error the job should act on when several ranks raised: a non-retryable memckpt
    error from any rank (a node over its RAM budget stops the job, though the lower ranks
    only saw their collective fail), else one that is not a lost peer (the error that made
    the others' collectives fail), else the lowest rank's."""
    ranked = sorted(errors, key=lambda e: e[0])
    for pick in (lambda c: isinstance(c, MemckptError) and not c.retryable,
                 lambda c: not is_peer_failure(c)):
        found = [e for e in ranked if pick(e[1])]
        if found:
            return found[0]
    return ranked[0]


def _classify(obs: Observation) -> Decision:
    if obs.during is not None and obs.during not in RECOVERY_PHASES:
        raise ValueError(f"Observation.during={obs.during!r}: one of {RECOVERY_PHASES} or None")
    if obs.died:
        died = tuple(sorted(set(obs.died)))
        gone = set(died)
        return Decision(Action.RECOVER, died_what(died, obs.during), died=died,
                        hung=tuple(r for r in obs.hung if r in gone))
    if obs.unloadable is not None:
        return Decision(Action.RAISE, error=unloadable_error(*obs.unloadable))
    if obs.stop_persisted is not None:
        return Decision(Action.STOP, step=obs.stop_persisted)
    if obs.hung:
        hung = list(obs.hung)
        return Decision(Action.RECOVER, hung_what(hung, obs.silent_nodes),
                        died=tuple(hung), hung=tuple(hung), silent_nodes=obs.silent_nodes)
    if obs.lost_holders:
        return Decision(Action.RECOVER, f"node(s) {[n[:12] for n in obs.lost_holders]} holding "
                        "replicas (and running no rank) died")
    # A raised error waits briefly for a peer's death to explain it (a collective that
    # failed because a peer died), unless no rank is left to wait for.
    settled = bool(obs.errors) and (not obs.pending or obs.error_age_s > ERROR_SETTLE_S)
    if settled and obs.stopped is None:
        if obs.unreachable is None and obs.pending:
            return Decision(Action.WAIT, probe=True)
        if obs.unreachable:
            dead = sorted(obs.unreachable)
            return Decision(Action.RECOVER, f"rank(s) {dead} unreachable", died=tuple(dead))
        rank, cause = _root_cause(obs.errors)
        if isinstance(cause, MemckptError) and not cause.retryable:
            return Decision(Action.RAISE, error=cause)
        if is_peer_failure(cause):
            return Decision(Action.RECOVER, f"rank {rank} lost a peer: {cause}")
        return Decision(Action.RAISE, error=cause)
    if obs.stopped is not None and (obs.pending or obs.errors):
        # a rank stopped after persisting the requested step; the others follow at their
        # next step or fail in a collective with it: both are expected
        return Decision(Action.STOP, step=obs.stopped, grace=True)
    if obs.pending:
        return Decision(Action.WAIT)
    if obs.stopped is not None:
        return Decision(Action.STOP, step=obs.stopped)
    return Decision(Action.FINISH)


class State(enum.Enum):
    """The driver's states; a terminal one ends :meth:`memckpt.runtime.driver.driver.Runtime.run`."""

    STARTING = "starting"  # starting a generation of workers
    RUNNING = "running"  # watching it
    RECOVERING = "recovering"  # ending it and planning the next from the surviving copies
    FINISHED = "finished"  # every rank returned, or a requested stop was persisted
    FAILED = "failed"  # raised

    @property
    def terminal(self) -> bool:
        return self in (State.FINISHED, State.FAILED)


_AFTER_RUNNING = {Action.WAIT: State.RUNNING, Action.FINISH: State.FINISHED,
                  Action.STOP: State.FINISHED, Action.RECOVER: State.RECOVERING,
                  Action.RAISE: State.FAILED}


def next_state(state: State, decision: Optional[Decision] = None) -> State:
    """The state after ``state`` (and, from RUNNING, after ``decision``). From STARTING
    or RECOVERING, a decision means a death interrupted them: RECOVER plans again with
    every dead rank (RECOVERING), RAISE fails the job."""
    if state.terminal:
        raise ValueError(f"{state.value} is terminal: the driver has stopped")
    if state is not State.RUNNING and decision is not None:
        if decision.action not in (Action.RECOVER, Action.RAISE):
            raise ValueError(f"a death during {state.value} decides recover or raise, "
                             f"not {decision.action.value}")
        return State.RECOVERING if decision.action is Action.RECOVER else State.FAILED
    if state is State.STARTING:
        return State.RUNNING
    if state is State.RECOVERING:
        return State.STARTING
    if decision is None:
        raise ValueError("the running state needs a decision to move on")
    return _AFTER_RUNNING[decision.action]
