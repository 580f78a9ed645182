"""Shared fixtures: a shared-memory temp dir; one local multi-node Ray cluster per session;
``wait_for``, the one way a test waits for something to happen."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, TypeVar, Union

import pytest

T = TypeVar("T")

# Ray Train starts a preemption watcher actor beside every worker group: it polls the nodes
# for a cloud provider's preemption notice, which a local cluster never gets. Each one costs
# ~3.7 CPU-s of imports, for ~30 worker groups a session. Set before any cluster starts, so
# every raylet (and the controllers it runs) inherits it; the drills test memckpt's callback,
# not Ray's preemption handling.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s), and
# a worker's ray.train.report blocks until the next poll: up to 2 s idle per checkpoint
# reported, per worker group started and per failure. 0.5 s, as docs/ray-train.md advises
# where checkpoints are reported (a poll that takes longer is waited on, not a failure).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


def wait_for(predicate: Callable[[], T], timeout: float, what: Union[str, Callable[[], str]],
             interval: float = 0.05) -> T:
    """Call ``predicate`` until it returns something true and return that; after ``timeout``
    seconds fail the test: "timed out after T s waiting for <what>". ``what`` may be a
    function, called only then, to show the state the wait ended in. ``predicate`` may raise
    (an ``assert`` that the thing being waited on is still alive) to fail at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:g} s waiting for {detail}")
        time.sleep(interval)


def shm_base() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


@pytest.fixture
def ram_root():
    """A fresh directory on the shared-memory tmpfs per test, removed afterwards."""
    path = tempfile.mkdtemp(prefix="memckpt-test-", dir=shm_base())
    yield path
    shutil.rmtree(path, ignore_errors=True)


class _Shared:
    """One 3-node local Ray cluster (2 CPUs a node, a 0-CPU head) for the whole session:
    starting and stopping one per module cost about 10 s each. Started on first use."""
    cluster = None

    @classmethod
    def get(cls):
        if cls.cluster is None:
            from memckpt.runtime.tools.local_cluster import LocalCluster
            # no log monitor (worker_logs=False): it re-reads the size of every log file any
            # worker of the session ever wrote, ten times a second (~600 files by the end),
            # to stream workers' prints to a driver; the tests read events and results
            cls.cluster = LocalCluster(nodes=3, cpus_per_node=2, connect=False,
                                       worker_logs=False)
        return cls.cluster

    @classmethod
    def stop(cls) -> None:
        if cls.cluster is not None:
            cls.cluster.shutdown()
            cls.cluster = None


@pytest.fixture(scope="session")
def _shared_cluster():
    yield _Shared
    _Shared.stop()


def _ready(c):
    """``c`` with 3 worker nodes again (a test may have removed some, or killed them through
    Ray) and this process connected to it (a test may have left it for a private cluster)."""
    import ray
    c.forget_dead_nodes()
    while len(c.nodes) < 3:
        c.add_node()
    if not ray.is_initialized():
        ray.init(address=c.address, namespace="memckpt", log_to_driver=True)
    return c


@pytest.fixture(scope="module")
def cluster(_shared_cluster, request):
    """The session's cluster, ready for this module; disconnected after it, so a module that
    starts its own cluster (the benchmarks, the elastic drills) can connect to that one.
    In a module that sets ``KEEP_WORKERS = True``, the module's ``memckpt.run`` jobs run
    inside ``memckpt.keep_workers()``: each takes the worker processes the one before it
    left instead of starting its own (~6 processes importing torch a drill). Modules that
    run Ray Train beside them do not: kept workers hold their CPUs."""
    import ray

    import memckpt
    c = _ready(_shared_cluster.get())
    if getattr(request.module, "KEEP_WORKERS", False):
        with memckpt.keep_workers():
            yield c
    else:
        yield c
    ray.shutdown()


@pytest.fixture
def full_cluster(cluster):
    """The module's cluster with 3 worker nodes again (a test may have removed some)."""
    return _ready(cluster)


STORE_JOB, STORE_NODE = "t", "nodeA"


@pytest.fixture
def store(ram_root):
    """A real ReplicaStore (no Ray) for job STORE_JOB on node STORE_NODE, cleared after."""
    from memckpt.runtime.node.replica_store import ReplicaStore
    s = ReplicaStore(ram_root=ram_root, job=STORE_JOB, node_id=STORE_NODE)
    yield s
    s.clear()


@pytest.fixture
def sender(store):
    """A worker's TCP connection into ``store`` (memckpt.runtime.wire.data_plane)."""
    from memckpt.runtime.wire.data_plane import StoreConnection
    snd = StoreConnection(store.address("127.0.0.1"), timeout_s=30)
    yield snd
    snd.close()


def held_replica(store, rank: int, step: int):
    """The bytes of ``rank``'s replica of ``step`` as ``store`` holds it on disk."""
    from memckpt.engine.shared_pages import read_bytes
    from memckpt.runtime.wire.ram_files import scan
    return read_bytes(scan(store.replicas)[rank][step])


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile memckpt and the tests' job modules to bytecode once. Where the environment
    sets PYTHONDONTWRITEBYTECODE (this machine and its CI do) nothing is cached, and every
    process the suite starts (hundreds of Ray actors, the demo's and the jobs' subprocesses)
    compiled memckpt again: ~0.15 CPU-s each. Python reads a cached file all the same."""
    import compileall

    import memckpt
    for folder in (Path(memckpt.__file__).parent, Path(__file__).parent):
        compileall.compile_dir(str(folder), quiet=1, workers=1)


# How much lower the process that runs the tests without Ray schedules itself (os.nice) under
# ``-n 2``: the drills keep their CPU, and those tests take what the drills leave idle.
NON_RAY_NICE = 10
_with_ray = _niced = False  # the selection has Ray drills; this process has lowered itself


def _is_ray(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("ray")) or bool(
        {"cluster", "full_cluster"} & set(getattr(item, "fixturenames", ())))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under ``-n 2 --dist loadgroup`` (pyproject's addopts) the suite runs in two processes,
    one group each. Every Ray drill runs in one, in the order collected (they share the
    session's cluster, its kept workers and module fixtures, and one drill's cluster at a
    time keeps their timing honest). The other runs the tests without Ray, at a lower CPU
    priority (:data:`NON_RAY_NICE`): the suite is bound by the CPU its processes need, the
    drills leave about a fifth of two cores idle (timers, heartbeats, Ray noticing a dead
    node), and those tests fill it instead of slowing the drills down while they run
    (docs/testing.md). Running the drills that start their own clusters in the second
    process was tried twice: on the earlier machine it was faster (about 20 min against 23)
    but a live rank missed its liveness ping; on this one it was not faster (each drill took
    1.5-2x its time alone). A selection without Ray drills leaves its tests ungrouped:
    every process takes them, at the usual priority."""
    global _with_ray
    _with_ray = any(_is_ray(item) for item in items)
    for item in items:
        if _is_ray(item):
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif _with_ray:
            item.add_marker(pytest.mark.xdist_group("no-ray"))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The process that runs the tests without Ray beside the drills lowers its priority,
    once (never a process that runs both kinds: ``-n 0``)."""
    global _niced
    if _with_ray and not _niced and "PYTEST_XDIST_WORKER" in os.environ and not _is_ray(item):
        os.nice(NON_RAY_NICE)
        _niced = True


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With MEMCKPT_TEST_TIMES=<file>, each test phase's seconds are appended to that file
    as it ends (where the suite's time goes, readable while it still runs); under xdist by
    the controlling process only."""
    path = os.environ.get("MEMCKPT_TEST_TIMES")
    if path and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as f:
            f.write(f"{time.time():.0f} {report.duration:8.2f} {report.when:8} {report.nodeid}\n")


# -- a job's coordinator, for drills that watch a run from outside --
def coordinator(name: str):
    import ray
    from memckpt.runtime.coordinator.coordinator import COORDINATOR_NAMESPACE, coordinator_name
    return ray.get_actor(coordinator_name(name), namespace=COORDINATOR_NAMESPACE)


def status_at(name: str, step: int) -> dict | None:
    """The run's coordinator status once it has seen ``step`` reached; None before (or before
    the coordinator has started)."""
    import ray
    try:
        coord = coordinator(name)
        if ray.get(coord.progress.remote()).max_step >= step:
            return ray.get(coord.status.remote())
    except (ValueError, ray.exceptions.RayError):
        pass  # not started yet
    return None


def fired(events: list[dict], target: str) -> dict:
    """The one ``fault_injected`` event of a run (its fault happened, once, at ``target``)."""
    hits = [e for e in events if e["event"] == "fault_injected"]
    assert len(hits) == 1 and hits[0]["target"] == target, hits
    return hits[0]


def fit_losing_a_node(name: str, loop, loop_config: dict, config, tmp_path,
                      at_step: int = 5) -> None:
    """A 3-rank ``TorchTrainer`` run of ``loop`` (one CPU a worker, spread over the nodes,
    memckpt's Ray Train callback with ``config``, events in ``tmp_path/run``) whose rank 1
    loses its node at ``at_step`` (a chaos event: the rank holds at that step while the
    callback kills its node). Checks that the run ended without error after exactly that
    loss, that memckpt planned the recovery around that node, and that every rank of the
    restarted group restored from RAM (its node's or a peer's), not from Ray Train's
    checkpoint or step 0."""
    import dataclasses
    import json

    import ray.train
    from ray.train.torch import TorchTrainer

    import memckpt
    from memckpt.ray_train import MemckptCallback
    config = dataclasses.replace(config, chaos=(memckpt.ChaosEvent(at_step, "node", 1),))
    trainer = TorchTrainer(
        loop, train_loop_config=loop_config,
        scaling_config=ray.train.ScalingConfig(num_workers=3, resources_per_worker={"CPU": 1},
                                               placement_strategy="SPREAD"),
        run_config=ray.train.RunConfig(
            name=name, storage_path=str(tmp_path / "storage"),
            failure_config=ray.train.FailureConfig(max_failures=3),
            callbacks=[MemckptCallback(config, run_dir=tmp_path / "run")]))
    result = trainer.fit()
    assert result.error is None
    ev = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    killed = fired(ev, "node")
    assert killed["ranks"] == [1] and killed["gen"] == 0
    (plan,) = [e for e in ev if e["event"] == "recovery_plan"]
    assert plan["dead_nodes"] == [killed["node"]] and plan["resumed_step"] == at_step - 1
    restored = [e for e in ev if e["event"] == "restored" and e["gen"] == 1]
    assert len(restored) == 3 and all(e["source"].startswith(("local:", "peer:")) for e in restored)
