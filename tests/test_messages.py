"""The messages between a worker and the driver are typed records with one definition
(:mod:`memckpt.runtime.worker.result`, the driver's :class:`~memckpt.runtime.driver.recovery.Failure`):
they check what they are given, survive Ray's pickling, and write the JSON keys the run
summary and the coordinator's state always had. And no driver module reads one of them back
by a string key (``r["died"]``, ``failure.get("grow_to")``): the AST check below holds it."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

from memckpt.runtime.driver.recovery import Failure
from memckpt.runtime.worker.result import (ReplicationTotals, RestoreReport, WorkerInfo,
                                           WorkerResult)

DRIVER = Path(__file__).resolve().parent.parent / "memckpt" / "runtime" / "driver"
MESSAGES = (WorkerResult, RestoreReport, WorkerInfo, ReplicationTotals, Failure)
# keys other dicts the driver reads also have: a strike's details (a TypedDict, the
# fault_injected event's fields) carry the "pid" hit; the recovery's own record (the run
# summary's) carries "fault_at" and "detected_at"
SHARED_KEYS = {"pid", "fault_at", "detected_at"}


def _string_key_reads(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, key) of every ``x["key"]`` and ``x.get("key", ...)`` / ``.pop`` / ``.setdefault``."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            key = node.slice.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "pop", "setdefault") and node.args
              and isinstance(node.args[0], ast.Constant)):
            key = node.args[0].value
        else:
            continue
        if isinstance(key, str):
            out.append((node.lineno, key))
    return out


def test_the_driver_reads_no_message_by_a_string_key() -> None:
    fields = {f.name for cls in MESSAGES for f in dataclasses.fields(cls)} - SHARED_KEYS
    found = [f"{path.name}:{line}: [{key!r}]"
             for path in sorted(DRIVER.glob("*.py"))
             for line, key in _string_key_reads(ast.parse(path.read_text()))
             if key in fields]
    assert not found, "read the typed record's attribute instead:\n" + "\n".join(found)


def test_the_check_sees_string_key_reads() -> None:
    tree = ast.parse('a = failure["died"]\nb = r.get("stopped")\nc = r.stopped\nd = x[0]\n')
    assert _string_key_reads(tree) == [(1, "died"), (2, "stopped")]


def test_the_worker_answers_with_the_records() -> None:
    from memckpt.runtime.driver.pool import Generation
    from memckpt.runtime.worker.worker import Worker

    assert inspect.signature(Worker.run).return_annotation == "WorkerResult"
    assert inspect.signature(Worker.info).return_annotation == "WorkerInfo"
    types = {f.name: f.type for f in dataclasses.fields(Generation)}
    assert types["results"].startswith("dict[int, WorkerResult]")
    assert types["info"].startswith("dict[int, WorkerInfo]")


def test_every_message_is_frozen() -> None:
    samples: list[Any] = [WorkerResult(0), RestoreReport(), WorkerInfo(0, 1, "n"), ReplicationTotals(0, 0),
               Failure("x")]
    assert {type(m) for m in samples} == set(MESSAGES)
    for msg in samples:
        name = dataclasses.fields(msg)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(msg, name, getattr(msg, name))


def test_restore_report_checks_its_values() -> None:
    report = RestoreReport(fetch_and_load_s=0.5, connect_s=0.01, install_s=0.2, fetch_s=0.1,
                           slot_alloc_s=0.05, fetch_bytes=1 << 20, recopied=True)
    assert dataclasses.replace(report, resnapshot_s=0.3).resnapshot_s == 0.3
    assert RestoreReport().recopied is False and RestoreReport().install_s is None
    with pytest.raises(ValueError, match="fetch_s"):
        RestoreReport(fetch_s=-1.0)
    with pytest.raises(ValueError, match="connect_s"):
        RestoreReport(connect_s=float("nan"))
    with pytest.raises(TypeError, match="recopied"):
        RestoreReport(recopied=1.0)  # type: ignore[arg-type]  # the old dict's flag
    with pytest.raises(TypeError, match="fetch_bytes"):
        RestoreReport(fetch_bytes=10.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dataclasses.replace(report, fetch_and_load=1.0)  # type: ignore[call-arg]  # no such field


def test_worker_result_checks_its_values() -> None:
    done = WorkerResult(2, {"loss": 0.1}, "ab" * 32, restore=RestoreReport(1.0),
                        source="local:/x", replication=ReplicationTotals(10, 0))
    assert done.stopped is None and done.restore is not None
    stopped = WorkerResult(1, stopped=7)
    assert stopped.result is None and stopped.digest is None
    with pytest.raises(ValueError, match="rank"):
        WorkerResult(-1)
    with pytest.raises(ValueError, match="stopped"):
        WorkerResult(1, digest="x", stopped=7)
    with pytest.raises(ValueError, match="sent_bytes"):
        ReplicationTotals(-1, 0)
    with pytest.raises(ValueError, match="pid"):
        WorkerInfo(None, -5, "n")


def test_messages_survive_pickling() -> None:
    """Ray carries them from the worker's process to the driver's with pickle."""
    msgs = [WorkerResult(0, [1, 2], "d", restore=RestoreReport(0.2, recopied=True),
                         replication=ReplicationTotals(3, 4)),
            WorkerInfo(3, 1234, "node-a"),
            Failure("rank(s) [1] died", (1,), detected_at=5.0, fault_at=4.0,
                    fault_from="injected")]
    for msg in msgs:
        assert pickle.loads(pickle.dumps(msg)) == msg


def test_json_edges_keep_their_keys() -> None:
    """The run summary's ``replication`` and the coordinator's ``workers`` (read by
    ``memckpt kill``) are written with :func:`dataclasses.asdict`: the keys they always had."""
    assert json.loads(json.dumps(dataclasses.asdict(ReplicationTotals(10, 4)))) == {
        "sent_bytes": 10, "filled_bytes": 4}
    assert dataclasses.asdict(WorkerInfo(0, 99, "n1")) == {"rank": 0, "pid": 99, "node_id": "n1"}


def test_the_json_shapes_spell_their_records() -> None:
    """Where a record goes out as JSON (the coordinator's status, its saved state), the
    TypedDict its readers are checked against names the record's fields, no more, no less."""
    from memckpt.runtime.coordinator.job_state import JobState, StopRequest
    from memckpt.runtime.coordinator.messages import (CoordinatorStatus, JobStateFields,
                                                      LivenessStatus, StopFields, UnitStatus)
    from memckpt.runtime.coordinator.steps import UnitProgress
    from memckpt.runtime.ray_nodes import Whereabouts, WorkerInfoFields

    def names(cls: Any) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    assert list(WorkerInfoFields.__annotations__) == names(WorkerInfo)
    assert list(JobStateFields.__annotations__) == names(JobState)
    assert list(StopFields.__annotations__) == names(StopRequest)
    assert list(UnitStatus.__annotations__) == names(UnitProgress) + ["age_s"]
    assert set(CoordinatorStatus.__annotations__) == (
        set(names(JobState)) | set(LivenessStatus.__annotations__)
        | {"units", "snapshots", "node_ram", "refused_stale"})
    assert UnitProgress(3, 2, 0.5, 10.0).status(12.0) == {
        "step": 3, "ranks": 2, "stall_max_s": 0.5, "time": 10.0, "landed": 0.0,
        "requested": 0.0, "age_s": 2.0}
    assert pickle.loads(pickle.dumps(Whereabouts("n", 7))) == Whereabouts("n", 7)
    with pytest.raises(ValueError, match="pid"):
        Whereabouts("n", -1)


def test_failure_checks_its_values() -> None:
    f = Failure("rank(s) [2] stopped heart-beating (hung)", hung=(2,), silent_nodes=("a", "b"),
                detected_at=10.0, fault_at=7.5, fault_from="last sign of life",
                last_sign_of_life_at=7.5)
    assert f.detect_s == 2.5 and f.died == () and f.grow_to is None
    assert Failure("resize", grow_to=4, detected_at=1.0).detect_s is None
    with pytest.raises(ValueError, match="what"):
        Failure("")
    with pytest.raises(ValueError, match="died"):
        Failure("x", died=(3, 1))
    with pytest.raises(ValueError, match="died"):
        Failure("x", died=[1])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="grow_to"):
        Failure("x", grow_to=0)
    with pytest.raises(ValueError, match="together"):
        Failure("x", fault_at=1.0)


def test_the_driver_reads_stopped_steps_from_results() -> None:
    from memckpt.runtime.driver.driver import Runtime
    from memckpt.runtime.driver.pool import Generation

    g = Generation(0, {}, {}, {0: WorkerInfo(0, 1, "n"), 1: WorkerInfo(1, 2, "n")})
    assert Runtime._stopped_step(g) is None
    g.results[0] = WorkerResult(0, stopped=5)
    g.results[1] = WorkerResult(1, stopped=6)
    assert Runtime._stopped_step(g) == 6
