"""Fault injection: kill a worker, a store, the coordinator or a whole node, on purpose.

One utility serves the tests, the CLI (``memckpt kill``), the demo and the
config's chaos schedule. Signals are delivered by a tiny Ray task pinned to the
victim's node, so it works on a real multi-machine cluster as well as on a
simulated one. A node is killed by SIGKILLing its raylet and every process
under it (its workers, store and object store) at once.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping, Optional, Sequence, TypedDict

from memckpt.config import ChaosEvent

if TYPE_CHECKING:
    from memckpt.runtime.ray_nodes import Whereabouts

STEADY_WAIT_S = 120.0  # how long a steady fault waits for the job's standby


def named_signal(name: str) -> signal.Signals:
    """The signal a fault or ``memckpt kill`` names: one of :data:`memckpt.config.SIGNALS`
    (``KILL``, ``STOP``, ``TERM``), or ``CONT``, which wakes a STOPped process."""
    return signal.Signals[f"SIG{name}"]


def _on_node(node_id: str):
    from memckpt.runtime.ray_nodes import on_node  # imported late: `import memckpt` stays light
    return on_node(node_id)


def _signal_task(pid: int, signum: int) -> bool:
    try:
        os.kill(pid, signum)
        return True
    except ProcessLookupError:
        return False


def kill_process_tree(root_pid: int, spare: Optional[int] = None) -> list[int]:
    """SIGKILL ``root_pid`` and every process below it, the children first (``spare``:
    a pid to leave for last, the caller itself). Returns the pids signalled.

    A node dies all at once: killing only its raylet would leave its worker processes
    running on until they notice (seconds), still training and streaming replicas."""
    return signal_process_tree(root_pid, signal.SIGKILL, spare)


def process_tree(root_pid: int) -> list[int]:
    """``root_pid`` and every process below it, the children first ([] if it is gone)."""
    import psutil
    try:
        root = psutil.Process(root_pid)
        return [p.pid for p in root.children(recursive=True)] + [root.pid]
    except psutil.NoSuchProcess:
        return []


def signal_process_tree(root_pid: int, signum: int, spare: Optional[int] = None) -> list[int]:
    """Send ``signum`` to ``root_pid`` and every process below it, the children first,
    except ``spare``. Returns the pids signalled."""
    done = []
    for pid in process_tree(root_pid):
        if pid == spare:
            continue
        try:
            os.kill(pid, signum)
            done.append(pid)
        except ProcessLookupError:
            pass
    return done


def _kill_node_task() -> int:
    me = os.getpid()
    killed = kill_process_tree(os.getppid(), spare=me)  # the raylet is this task's parent
    os.kill(me, signal.SIGKILL)
    return len(killed)


def _freeze_node_task() -> list[int]:
    me = os.getpid()
    frozen = signal_process_tree(os.getppid(), signal.SIGSTOP, spare=me)  # the raylet's tree
    # this task's own worker last, once its answer (sent directly to the caller, not
    # through the stopped raylet) is on its way
    threading.Timer(0.5, os.kill, (me, signal.SIGSTOP)).start()
    return frozen + [me]


def freeze_node(node_id: str) -> list[int]:
    """Freeze a node: SIGSTOP its raylet and every process under it (workers, store,
    agents). Nothing is closed or reset, as when a machine hangs or is cut off: Ray calls
    the node dead only when its health checks time out (about a minute by default), while
    memckpt finds it by its store's silence. Returns the pids stopped; ``kill -CONT`` on
    that machine thaws them (a healed partition: the job fences what wakes up)."""
    import ray
    task = ray.remote(num_cpus=0, max_retries=0)(_freeze_node_task)
    return list(ray.get(task.options(scheduling_strategy=_on_node(node_id)).remote(),
                        timeout=30))


def send_signal(node_id: str, pid: int, sig: str = "KILL", timeout_s: float = 30.0) -> bool:
    """Deliver ``sig`` to process ``pid`` on node ``node_id``; False if it was already gone."""
    return send_signals([(node_id, pid)], sig, timeout_s)[0]


def send_signals(targets: Sequence[tuple[str, int]], sig: str = "KILL",
                 timeout_s: float = 30.0, wait: bool = True) -> list[bool]:
    """Deliver ``sig`` to every (node, pid) of ``targets`` in the same instant: every
    signalling task is sent before any answer is awaited. Per target: False if its process
    was already gone.

    ``wait=False``: send and return ``[]`` at once. For a node that stopped answering
    (frozen, cut off): its raylet runs the task if it ever wakes, so a process that comes
    back from a freeze is killed then, and nobody waits on it meanwhile."""
    import ray
    task = ray.remote(num_cpus=0, max_retries=0)(_signal_task)
    refs = [task.options(scheduling_strategy=_on_node(node)).remote(pid, named_signal(sig))
            for node, pid in targets]
    if not wait:
        return []
    return [bool(x) for x in ray.get(refs, timeout=timeout_s)]


def kill_node(node_id: str) -> None:
    """Hard-kill a node: SIGKILL its raylet and every process under it (workers, store)."""
    import ray
    task = ray.remote(num_cpus=0, max_retries=0)(_kill_node_task)
    ref = task.options(scheduling_strategy=_on_node(node_id)).remote()
    try:
        ray.get(ref, timeout=30)
    except ray.exceptions.RayError:
        pass  # the task's own worker may die with the raylet before it replies


@dataclass(frozen=True)
class Fault(ChaosEvent):
    """A fault the runtime fires: a :class:`memckpt.config.ChaosEvent` (the same fields,
    checked the same way), from the config's chaos schedule or a :class:`FaultInjector`.
    At ``step`` (:attr:`at_step`: the first time any rank reports it), hit ``target``.
    ``steady``: the rank that fires it first waits (up to ``STEADY_WAIT_S``) until the job
    is in standby, every node's warm spare up with its memory in hand, as a job is after its
    first minute; a benchmark measures recovery there, not against spares still starting.

    ``ranks``: several ranks' workers (or nodes) at once, signalled by the driver in the
    same instant. ``during``: not at a step but in that phase of the first recovery once
    training reached ``at_step`` (:data:`memckpt.config.CHAOS_PHASES`), fired by the driver.

    One thing more than a config's event: a worker fault may name no rank
    (``FaultInjector.kill_worker(rank=None)``), and the runtime picks one still running."""

    NEEDS_RANK: ClassVar[tuple[str, ...]] = ("node", "store")

    @classmethod
    def from_chaos(cls, ev: ChaosEvent) -> "Fault":
        return cls(**{f.name: getattr(ev, f.name) for f in dataclasses.fields(ev)})

    @property
    def at_step(self) -> int:
        """The step it fires at (``step``)."""
        return self.step

    @property
    def victims(self) -> tuple[Optional[int], ...]:
        """The ranks it hits (None: the runtime picks one)."""
        return self.ranks or (self.rank,)

    @property
    def claimer(self) -> int:
        """The rank that fires a step fault when it reaches ``at_step``."""
        return self.ranks[0] if self.ranks else (self.rank if self.rank is not None else 0)

    @property
    def self_inflicted(self) -> bool:
        """A step fault the rank delivers to its own process; the rest the driver carries
        out, the claiming rank holding still meanwhile (several ranks, a node, a store)."""
        return self.target == "worker" and len(self.victims) == 1 and self.during is None

    @property
    def key(self) -> str:
        who = ",".join(map(str, self.ranks)) if self.ranks else self.rank
        return f"{self.target}:{who}:{self.at_step}:{self.signal}" + (
            f":during-{self.during}" if self.during else "") + (
            f":byte-{self.at_byte}" if self.at_byte is not None else "")


def fire(fault: Fault, coordinator: Any) -> None:
    """Fire a step fault from the rank that claims it (once per job: the coordinator's
    claim): a worker's own signal at once; the rest the driver carries out while this
    thread waits (its node's loss takes this process with it)."""
    import ray
    wait = STEADY_WAIT_S if fault.steady else 0.0
    if not ray.get(coordinator.claim.remote(fault.key, wait)):
        return
    if fault.self_inflicted:
        os.kill(os.getpid(), named_signal(fault.signal))
    else:  # several ranks, node, store, coordinator, random: the driver acts
        ray.get(coordinator.request_fault.remote(fault.key))
        ray.get(coordinator.wait_fault.remote(fault.key, 60.0))


class StrikeDetails(TypedDict):
    """A strike as the ``fault_injected`` event and the injector's record have it: the first
    rank hit, its node and pid, every rank hit, and the fault's target, signal and phase."""

    target: str
    rank: int
    node: str
    pid: int
    signal: str
    ranks: list[int]
    during: Optional[str]


@dataclass(frozen=True)
class Strike:
    """Whom a fault the runtime carries out hits: its ranks and their (node, pid)."""

    fault: Fault
    ranks: tuple[int, ...]
    nodes: tuple[str, ...]
    pids: tuple[int, ...]

    def details(self) -> StrikeDetails:
        """What the event log and the injector record of it."""
        return StrikeDetails(target=self.fault.target, rank=self.ranks[0], node=self.nodes[0],
                             pid=self.pids[0], signal=self.fault.signal, ranks=list(self.ranks),
                             during=self.fault.during)


def aim(fault: Fault, procs: Mapping[int, tuple[str, int]]) -> Optional[Strike]:
    """The ranks ``fault`` hits among ``procs`` (rank -> (node, pid) of the running
    generation; a random rank where it names none); None when none of them runs now (a
    fault during a start, before its rank started)."""
    ranks = [r if r is not None else random.choice(sorted(procs)) for r in fault.victims]
    ranks = [r for r in ranks if r in procs]
    if not ranks:
        return None
    return Strike(fault, tuple(ranks), tuple(procs[r][0] for r in ranks),
                  tuple(procs[r][1] for r in ranks))


def deliver(strike: Strike, *, store_pid: Callable[[str], int], coordinator: Any,
            node_killer: Optional[Callable[[str], None]] = None) -> None:
    """Carry out a fault the runtime fires (the driver, or the Ray Train callback's
    watchdog): several ranks' workers in the same instant, their nodes, the first rank's
    node's store (``store_pid(node)``), or the job's coordinator."""
    import ray
    fault = strike.fault
    if fault.target in ("worker", "random"):
        send_signals(list(zip(strike.nodes, strike.pids)), fault.signal)
    elif fault.target == "node":
        for n in dict.fromkeys(strike.nodes):
            if fault.signal == "STOP":
                freeze_node(n)
            else:
                (node_killer or kill_node)(n)
    elif fault.target == "store":
        send_signal(strike.nodes[0], store_pid(strike.nodes[0]), fault.signal)
    elif fault.target == "coordinator":
        where: Whereabouts = ray.get(coordinator.whereabouts.remote())
        send_signal(where.node_id, where.pid, fault.signal)


@dataclass
class FaultInjector:
    """A schedule of faults the runtime fires as training progresses (each once per job).

    ``node_killer`` replaces :func:`kill_node` (tests pass ``cluster.remove_node``).
    """

    faults: list[Fault] = field(default_factory=list)
    node_killer: Optional[Callable[[str], None]] = None
    fired: list[dict[str, Any]] = field(default_factory=list)

    def kill_worker(self, rank: Optional[int], at_step: int, signal: str = "KILL",
                    steady: bool = False, during: Optional[str] = None,
                    at_byte: Optional[int] = None) -> "FaultInjector":
        """Signal ``rank``'s worker at ``at_step``, or (``during``) in that phase of the
        first recovery once training reached ``at_step``, or (``at_byte``) once that many
        bytes of its shard of ``at_step`` crossed to its first replica holder. ``rank``
        None: one the runtime picks among the ranks whose worker still runs then (during a
        recovery: a survivor it has not killed itself)."""
        self.faults.append(Fault(at_step, "worker", rank, signal, steady, during=during,
                                 at_byte=at_byte))
        return self

    def kill_workers(self, ranks: Sequence[int], at_step: int, signal: str = "KILL",
                     during: Optional[str] = None) -> "FaultInjector":
        """Signal several ranks' workers in the same instant."""
        self.faults.append(Fault(at_step, "worker", None, signal, ranks=tuple(ranks),
                                 during=during))
        return self

    def kill_nodes(self, ranks: Sequence[int], at_step: int) -> "FaultInjector":
        """Kill the nodes that run ``ranks``, all at once."""
        self.faults.append(Fault(at_step, "node", None, ranks=tuple(ranks)))
        return self

    def kill_node(self, rank: int, at_step: int, steady: bool = False,
                  signal: str = "KILL", at_byte: Optional[int] = None) -> "FaultInjector":
        """Kill the node that runs ``rank`` when training reaches ``at_step`` (``signal``
        "STOP": freeze it, :func:`freeze_node`), or (``at_byte``) once that many bytes of
        ``rank``'s shard of ``at_step`` crossed to its first replica holder."""
        self.faults.append(Fault(at_step, "node", rank, signal=signal, steady=steady,
                                 at_byte=at_byte))
        return self

    def kill_store(self, rank: int, at_step: int) -> "FaultInjector":
        self.faults.append(Fault(at_step, "store", rank))
        return self

    def kill_coordinator(self, at_step: int) -> "FaultInjector":
        self.faults.append(Fault(at_step, "coordinator"))
        return self

    def record(self, fault: Fault, **details) -> None:
        self.fired.append(dict(key=fault.key, target=fault.target, rank=fault.rank,
                               signal=fault.signal, at_step=fault.at_step, time=time.time(),
                               **details))

    def during(self, phase: str) -> list[Fault]:
        """The faults that fire in ``phase`` of a recovery and have not fired yet."""
        done = {f["key"] for f in self.fired}
        return [f for f in self.faults if f.during == phase and f.key not in done]

    def at_steps(self) -> tuple[Fault, ...]:
        """The faults the ranks fire at their step (what a worker is given)."""
        return tuple(f for f in self.faults if f.during is None)
