"""Fault schedules for several ranks at once and for a phase of a recovery (no Ray)."""

from __future__ import annotations

import argparse

import pytest

import memckpt
from memckpt.cli.kill import ranks_arg
from memckpt.config import ChaosEvent
from memckpt.errors import ConfigError
from memckpt.runtime.chaos.faults import Fault, FaultInjector, aim


def test_a_fault_on_several_ranks_is_carried_out_by_the_driver_for_all_of_them():
    f = Fault.from_chaos(ChaosEvent(step=6, target="worker", ranks=(2, 0)))
    assert f.victims == (2, 0) and f.claimer == 2  # rank 2 reaching step 6 asks the driver
    assert not f.self_inflicted  # one rank killing itself could not kill the others too
    assert f.key == "worker:2,0:6:KILL"


def test_a_fault_is_a_chaos_event_that_may_leave_a_workers_rank_to_the_runtime():
    """One definition of a fault's fields and checks (the config's ChaosEvent); the runtime's
    Fault only adds that ``kill_worker(rank=None)`` lets it pick a running rank."""
    ev = ChaosEvent(step=6, target="node", rank=1, signal="STOP", steady=True)
    f = Fault.from_chaos(ev)
    assert isinstance(f, ChaosEvent) and f.at_step == f.step == 6
    assert (f.target, f.rank, f.signal, f.steady, f.ranks, f.during) == \
        (ev.target, ev.rank, ev.signal, ev.steady, ev.ranks, ev.during)
    assert Fault(3, "worker", None, during="plan").victims == (None,)
    with pytest.raises(ConfigError, match="chaos.rank"):
        ChaosEvent(step=3, target="worker")  # a config names its rank, or says random
    with pytest.raises(ConfigError, match="chaos.signal"):
        FaultInjector().kill_worker(1, at_step=2, signal="HUP")  # the config's checks hold
    with pytest.raises(ConfigError, match="chaos.rank"):
        Fault(3, "store")


def test_a_single_rank_worker_fault_is_the_ranks_own_and_others_the_drivers():
    assert Fault(6, "worker", 1).self_inflicted and Fault(6, "worker", 1).claimer == 1
    assert not Fault(6, "node", 1).self_inflicted
    assert Fault(6, "coordinator").claimer == 0  # no rank named: rank 0 asks


def test_a_fault_naming_no_rank_hits_one_of_the_ranks_still_running():
    """The driver hands ``aim`` only the workers a recovery has not killed itself: a
    survivor it killed for staying stuck past the grace is not a victim (ranks 0 and 2 run
    here; a pick by position would name rank 1, gone, half the time)."""
    procs = {0: ("nodeA", 100), 2: ("nodeC", 102)}
    fault = Fault(1, "worker", None, during="plan")
    hits = {aim(fault, procs).ranks for _ in range(200)}
    assert hits == {(0,), (2,)}
    strike = aim(Fault(1, "worker", 2, during="plan"), procs)
    assert strike is not None and strike.pids == (102,) and strike.nodes == ("nodeC",)
    assert aim(Fault(1, "worker", 1, during="plan"), procs) is None  # its rank is gone


def test_faults_during_a_recovery_stay_with_the_driver_until_they_fire():
    inj = (FaultInjector().kill_worker(1, at_step=6)
           .kill_worker(2, at_step=1, during="restore").kill_workers((0, 1), at_step=9))
    assert [f.during for f in inj.at_steps()] == [None, None]  # what the ranks are given
    (during,) = inj.during("restore")
    assert during.key.endswith(":during-restore") and not inj.during("plan")
    inj.record(during)
    assert inj.during("restore") == []  # once per job


@pytest.mark.parametrize("kwargs,words", [
    ({"ranks": (0, 0)}, ["chaos.ranks", "once"]),
    ({"ranks": (0, 1), "rank": 0}, ["chaos.ranks", "either rank or ranks"]),
    ({"ranks": (0, 1), "target": "store"}, ["chaos.ranks", "'worker' or 'node'"]),
    ({"ranks": (-1, 1)}, ["chaos.ranks"]),
    ({"ranks": "0,1"}, ["chaos.ranks", "tuple"]),
    ({"rank": 1, "during": "lunch"}, ["chaos.during", "plan"]),
    ({"target": "coordinator", "during": "plan"}, ["chaos.during", "'worker' or 'node'"]),
])
def test_bad_multi_rank_or_during_chaos_is_one_clear_error(kwargs, words):
    with pytest.raises(ConfigError) as e:
        ChaosEvent(step=5, **kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_chaos_ranks_are_checked_against_the_world_size():
    with pytest.raises(ConfigError, match=r"chaos.rank=3 is invalid: ranks run from 0 to 2"):
        memckpt.Config(workers=memckpt.WorkersConfig(num_workers=3),
                       chaos=(ChaosEvent(step=5, ranks=[1, 3]),))
    assert ChaosEvent(step=5, ranks=[0, 1]).ranks == (0, 1)  # a list from a config file


def test_memckpt_kill_takes_several_ranks():
    assert ranks_arg("1") == [1] and ranks_arg("0,1") == [0, 1]
    for bad in ("x", "0,0", "-1", "0,,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            ranks_arg(bad)
