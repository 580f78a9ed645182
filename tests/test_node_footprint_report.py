"""A node's memckpt host-RAM footprint on its way to ``memckpt status`` and ``memckpt report``
(no Ray): the store measures it, its uplink sends it with a heartbeat every few seconds, the
coordinator keeps the latest per node and logs each new peak, the CLI prints it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psutil

from memckpt.cli import main
from memckpt.cli.report import load_timeline, node_ram
from memckpt.cli.status import format_status, ram_line, ram_lines
from memckpt.engine.buffers import RamRegion
from memckpt.policy.footprint import budget_bytes
from memckpt.runtime.coordinator.coordinator import Coordinator, MemoryStateStore
from memckpt.runtime.coordinator.messages import Heartbeat
from memckpt.runtime.node.replica_store import ReplicaStore
from memckpt.runtime.wire.ram_files import own_dir
from memckpt.runtime.node.uplink import FOOTPRINT_EVERY_S, Uplink

GIB = 1 << 30


def test_ram_line_and_one_line_per_live_node():
    assert ram_line(3 * GIB // 2, 8 * GIB) == "RAM held 1.50 GiB of budget 8.00 GiB (19%)"
    assert ram_line(0, 0) == "RAM held 0 B of budget 0 B"  # no share of no budget
    nodes = {"b" * 20: {"held": 4 << 20, "budget": 64 << 20, "peak": 6 << 20},
             "a" * 20: {"held": 2 << 20, "budget": 64 << 20, "peak": 2 << 20}}
    assert ram_lines(nodes) == [
        "  node aaaaaaaaaaaa: RAM held 2.00 MiB of budget 64.0 MiB (3%)",
        "  node bbbbbbbbbbbb: RAM held 4.00 MiB of budget 64.0 MiB (6%), peak 6.00 MiB"]
    assert ram_lines(nodes, live=["a" * 20]) == ram_lines({"a" * 20: nodes["a" * 20]})


def test_status_shows_each_live_nodes_footprint_after_the_ranks():
    status = {"gen": 1, "committed": 7, "restarts_of_coordinator": 0,
              "assignment": {"0": "nodeA"}, "holders": {"0": ["nodeB"]},
              "units": {"nodeA": {"step": 8, "ranks": 1, "stall_max_s": 0.01, "age_s": 1.0}},
              "node_beats": {"nodeA": {"age_s": 0.1, "step": 8},
                             "nodeB": {"age_s": 0.2, "step": 8}},
              "node_ram": {"nodeA": {"held": 2 * GIB, "budget": 8 * GIB, "peak": 2 * GIB},
                           "nodeB": {"held": GIB, "budget": 8 * GIB, "peak": GIB},
                           "deadC": {"held": GIB, "budget": 8 * GIB, "peak": GIB}}}
    lines = format_status("gpt", status, now=100.0).splitlines()
    at = lines.index("memckpt's host RAM per node (its files, against Config.ram_budget):")
    assert lines[at + 1:] == ["  node nodeA: RAM held 2.00 GiB of budget 8.00 GiB (25%)",
                              "  node nodeB: RAM held 1.00 GiB of budget 8.00 GiB (12%)"]
    del status["node_ram"]  # a coordinator that heard of none yet: no heading
    assert "host RAM" not in format_status("gpt", status, now=100.0)


def _coordinator(tmp_path) -> Coordinator:
    c = Coordinator("job", str(tmp_path), 2, state=MemoryStateStore(),
                    inventory=lambda names, t: {})
    asyncio.run(c.configure(0, {0: "a", 1: "b"}, {0: ["b"], 1: ["a"]}, None,
                            {"a": "a", "b": "b"}))
    return c


def _events(tmp_path, kind: str) -> list[dict[str, Any]]:
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    return [e for e in events if e["event"] == kind]


def test_coordinator_keeps_the_latest_per_node_and_logs_each_new_peak(tmp_path):
    c = _coordinator(tmp_path)
    for held in (100, 300, 300, 200, 300, 400):
        assert asyncio.run(c.node_heartbeat("a", Heartbeat(0, 3, 0.1, ram=(held, 1000))))
    assert asyncio.run(c.node_heartbeat("a", Heartbeat(0, 3, 0.1)))  # without the footprint
    newer = Heartbeat(1, 3, 0.1, ram=(999, 1000))
    assert asyncio.run(c.node_heartbeat("b", newer)) is True  # a newer generation
    status = asyncio.run(c.status())
    assert status["node_ram"] == {"a": {"held": 400, "budget": 1000, "peak": 400}}
    assert [e["held_bytes"] for e in _events(tmp_path, "node_ram")] == [100, 300, 400]
    # what memckpt report makes of them: the peak per node, and the budget
    assert node_ram(_events(tmp_path, "node_ram")) == {
        "a": {"peak_bytes": 400, "budget_bytes": 1000}}


def test_report_prints_each_nodes_peak_against_its_budget(tmp_path, capsys):
    lines = [{"time": 1.0, "event": "job_started", "world_size": 2},
             {"time": 2.0, "event": "node_ram", "node": "n" * 20, "held_bytes": GIB,
              "budget_bytes": 8 * GIB},
             {"time": 3.0, "event": "node_ram", "node": "n" * 20, "held_bytes": 2 * GIB,
              "budget_bytes": 8 * GIB}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert load_timeline(tmp_path)["node_ram"] == {
        "n" * 20: {"peak_bytes": 2 * GIB, "budget_bytes": 8 * GIB}}
    assert main(["report", str(tmp_path)]) == 0
    assert "  node nnnnnnnnnnnn: peak RAM held 2.00 GiB of budget 8.00 GiB (25%)" \
        in capsys.readouterr().out.splitlines()


class _Sent:
    """A coordinator handle that records the node_heartbeat calls it is given."""

    def __init__(self) -> None:
        self.rams: list[Any] = []
        sent = self

        class NodeHeartbeat:
            @staticmethod
            def remote(node: str, hb: Heartbeat) -> str:
                sent.rams.append(hb.ram)
                return "ref"
        self.node_heartbeat = NodeHeartbeat


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _never(ref: Any, timeout_s: float) -> Any:
    raise TimeoutError  # the beat's answer: never looked at in these tests


def test_the_footprint_rides_a_heartbeat_at_most_every_few_seconds():
    clock, sent, measured = _Clock(), _Sent(), []

    def footprint() -> tuple[int, int]:
        measured.append(clock.t)
        return 4096 * len(measured), 1 << 30

    up = Uplink("a", clock=clock, get=_never, footprint=footprint)
    try:
        assert up.join(0, 0, [0], sent, interval_s=60.0)
        up.close()  # the beat thread ends: this test ticks
        up._closed.clear()
        for _ in range(int(2 * FOOTPRINT_EVERY_S / 0.5) + 1):  # every 0.5 s for 10 s
            assert up.heartbeat_once()
            clock.t += 0.5
        assert measured == [0.0, FOOTPRINT_EVERY_S, 2 * FOOTPRINT_EVERY_S]
        assert [r for r in sent.rams if r is not None] == [(4096, 1 << 30), (8192, 1 << 30),
                                                           (12288, 1 << 30)]
        assert len(sent.rams) == 21  # every beat went, most of them without it
    finally:
        up.close()


def test_a_failing_footprint_never_stops_the_heartbeat():
    def broken() -> tuple[int, int]:
        raise OSError("the tmpfs went away")

    sent = _Sent()
    up = Uplink("a", clock=_Clock(), get=_never, footprint=broken)
    try:
        assert up.join(0, 0, [0], sent, interval_s=60.0)
        up.close()
        up._closed.clear()
        assert up.heartbeat_once() and sent.rams == [None]
    finally:
        up.close()


def test_the_store_measures_its_nodes_files_and_budget(ram_root):
    store = ReplicaStore(ram_root, "job", "nodeA", ram_budget=64 << 20)
    try:
        assert store.footprint() == (0, 64 << 20)
        region = RamRegion.create(own_dir(store.root.parent.parent, "job", "nodeA")
                                  / "rank0" / "slot0.shard", 1 << 20)
        region.close()
        held, budget = store.footprint()
        assert held >= 1 << 20 and budget == 64 << 20
        frac = ReplicaStore(ram_root, "job", "nodeB")  # Config.ram_budget's default, 0.5
        assert frac.footprint()[1] == budget_bytes(0.5, psutil.virtual_memory().total)
        frac.clear()
    finally:
        store.clear()
