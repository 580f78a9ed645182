"""A multi-node Ray cluster on one machine, for drills, the demo and the tests.

Each "node" is a real raylet with its own object store and worker processes, so
removing one is a real node failure. The head runs no training (0 CPUs) and
hosts the driver and the coordinator. Health checks are tightened so a
hard-killed node is declared dead in under 1 s instead of Ray's default ~30 s.

Every port of every node is left to Ray, which binds port 0 and publishes what the
kernel gave it: a port picked by probing for a free one and handed over later can be
taken in between by another cluster's process on the machine (Linux lets two
SO_REUSEADDR sockets bind one port while neither listens; the first to listen wins),
and a raylet then talks to a foreign agent. Only the dashboard's port may be fixed
(``dashboard_port``), for the URL users type; 0 picks a free one too.

Every cluster, and every node in it, has a Ray temp dir of its own (sessions, sockets, logs,
the runtime-env agents' unpacked packages), as separate machines would:

- Ray resolves "auto" (what ``ray job submit`` hands a job's entrypoint as ``RAY_ADDRESS``)
  from ``ray_current_cluster`` in the head's temp dir. Under Ray's shared default
  (``/tmp/ray``) that file names whichever cluster on the machine started last, and a job
  submitted to an older one ran its driver on the newer one.
- Each node's runtime-env agent unpacks a job's ``--working-dir`` under its own session
  folder. Nodes sharing one folder had three agents remove and extract the same package
  into it while another node's actor imported from it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from types import MappingProxyType
from pathlib import Path
from typing import Any, Iterator, Optional

from memckpt.util.fsutil import write_atomic

# A dead raylet refuses the check at once: declared dead after ~threshold x period (0.8 s).
# A live raylet that stalls is declared dead only after ~threshold x (period + timeout)
# (2.8 s) without answering; the cluster configs in cluster/ use the same values.
FAST_HEALTH_CHECKS: Mapping[str, int] = MappingProxyType({  # read-only: Ray adds to
    "health_check_period_ms": 200,                        # the dict it is given
    "health_check_failure_threshold": 4,
    "health_check_timeout_ms": 500,
})
# Ray puts Unix sockets at <temp dir>/<session, ~41 chars>/sockets/plasma_store (21 more), and
# Linux caps a socket's path at 107 bytes: a node's temp dir must stay this short.
MAX_TEMP_DIR_CHARS = 40


def checked_temp_dir(path: str) -> str:
    """``path`` made absolute; ValueError naming the limit if its nodes' socket paths would
    be too long for Linux."""
    path = os.path.abspath(path)
    room = MAX_TEMP_DIR_CHARS - len("/node9999")
    if len(path) > room:
        raise ValueError(f"the local cluster's temp dir {path!r} is too long: Ray's socket paths "
                         f"under it would pass Linux's 107-byte limit; pick one of at most "
                         f"{room} characters")
    return path


class LocalCluster:
    """``nodes`` worker nodes of ``cpus_per_node`` CPUs each, plus a 0-CPU head.

    ``worker_logs=False`` starts no log monitor: what workers print stays in their log
    files (``<temp_dir>/node<i>/session_latest/logs``) instead of reaching the driver. The monitor
    polls every log file the cluster's workers ever wrote ten times a second, so on a
    long-lived cluster that starts thousands of workers (a test session) it takes a
    growing share of a core.

    ``node_labels``: the Ray node labels of each worker node in turn (``{"rack": "r1"}``,
    as ``ray start --labels rack=r1`` gives them; for ``placement.failure_domain``); nodes
    past its end, and the head, have none.

    ``health_checks``: the GCS's node health-check settings (:data:`FAST_HEALTH_CHECKS`);
    ``{}`` keeps Ray's defaults, as a production cluster runs them: a frozen node is then
    declared dead only after about a minute, and a thawed one carries on as the same node
    (the frozen-node drill).

    ``temp_dir``: the folder under which the head (``<temp_dir>/head``) and each node
    (``<temp_dir>/node<i>``) keep their Ray temp dirs (logs: ``<...>/session_latest/logs``);
    by default a new one under ``/tmp``. Kept after :meth:`shutdown`, as Ray keeps
    ``/tmp/ray``."""

    def __init__(self, nodes: int = 3, cpus_per_node: int = 2, object_store_mb: int = 256,
                 namespace: str = "memckpt", connect: bool = True, dashboard: bool = False,
                 worker_logs: bool = True, dashboard_port: int = 0,
                 node_labels: Optional[Sequence[Mapping[str, str]]] = None,
                 health_checks: Mapping[str, int] = FAST_HEALTH_CHECKS,
                 temp_dir: Optional[str] = None) -> None:
        self.temp_dir = checked_temp_dir(temp_dir) if temp_dir else \
            tempfile.mkdtemp(prefix="memckpt-ray-", dir="/tmp")
        # A throwaway local cluster needs no token; a real head keeps Ray's default.
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        import ray
        from ray._private.utils import get_ray_address_file, write_ray_address
        from ray.cluster_utils import Cluster

        self.cpus_per_node = cpus_per_node
        self.object_store_mb = object_store_mb
        self._added = 0  # nodes added so far: names each one's temp dir
        # Ray's Cluster also writes the machine-wide "auto" file (/tmp/ray/ray_current_cluster)
        # and fails where that folder was never made (a machine no Ray ran on before)
        os.makedirs(os.path.dirname(get_ray_address_file(None)), exist_ok=True)
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            temp_dir=os.path.join(self.temp_dir, "head"),
            num_cpus=0, object_store_memory=object_store_mb << 20, include_dashboard=dashboard,
            dashboard_host="127.0.0.1", dashboard_port=dashboard_port,
            # the head's agent (it runs submitted jobs) on a port Ray binds itself, not on
            # Ray's fixed 52365 (the worker nodes' agents: Cluster passes 0 already)
            dashboard_agent_listen_port=0, include_log_monitor=worker_logs,
            _system_config=dict(health_checks)))
        # "auto" inside this cluster (a submitted job's entrypoint) means this cluster
        os.makedirs(os.path.join(self.temp_dir, "head"), exist_ok=True)
        write_ray_address(self.cluster.address, os.path.join(self.temp_dir, "head"))
        self.nodes: dict[str, Any] = {}
        labels = list(node_labels or ())
        for i in range(nodes):
            self.add_node(labels[i] if i < len(labels) else None)
        self.cluster.wait_for_nodes()
        self.connected = connect
        if connect:
            ray.init(address=self.cluster.address, namespace=namespace, log_to_driver=True)

    @property
    def address(self) -> str:
        return self.cluster.address

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.cluster.webui_url}"

    def add_node(self, labels: Optional[Mapping[str, str]] = None) -> str:
        """One more worker node (with those Ray node ``labels``); returns its node id."""
        self._added += 1
        node = self.cluster.add_node(num_cpus=self.cpus_per_node,
                                     object_store_memory=self.object_store_mb << 20,
                                     temp_dir=os.path.join(self.temp_dir, f"node{self._added}"),
                                     **({"labels": dict(labels)} if labels else {}))
        self.nodes[node.node_id] = node
        return node.node_id

    def node_pids(self, node_id: str) -> list[int]:
        """Every process of that node: its raylet and all below it (workers, the job's
        store, agents); the raylet last."""
        from ray._private import ray_constants

        from memckpt.runtime.chaos.faults import process_tree
        raylets = self.nodes[node_id].all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
        return [pid for info in raylets for pid in process_tree(info.process.pid)]

    def remove_node(self, node_id: str) -> None:
        """Kill every process of that node at once (no graceful shutdown): its raylet's
        whole process tree (workers, store actor, agents) first, then Ray's bookkeeping."""
        from ray._private import ray_constants

        from memckpt.runtime.chaos.faults import kill_process_tree
        node = self.nodes.pop(node_id)
        for info in node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, []):
            kill_process_tree(info.process.pid)
        self.cluster.remove_node(node, allow_graceful=False)

    def forget_dead_nodes(self) -> list[str]:
        """Drop from this object the nodes whose raylet is gone without :meth:`remove_node`
        (a drill killed it through Ray: ``memckpt kill --node``, a chaos event), so that
        :meth:`add_node` can replace them. Returns their ids."""
        from ray._private import ray_constants
        gone = []
        for node_id, node in list(self.nodes.items()):
            raylets = node.all_processes.get(ray_constants.PROCESS_TYPE_RAYLET, [])
            if raylets and all(info.process.poll() is not None for info in raylets):
                self.remove_node(node_id)  # what the kill left (agents): gone too
                gone.append(node_id)
        return gone

    def shutdown(self) -> None:
        import ray
        if self.connected:
            ray.shutdown()
        self.cluster.shutdown()


@contextmanager
def local_cluster(nodes: int = 3, cpus_per_node: int = 2,
                  object_store_mb: Optional[int] = None) -> Iterator[LocalCluster]:
    c = LocalCluster(nodes, cpus_per_node, object_store_mb or 256)
    try:
        yield c
    finally:
        c.shutdown()


def main(argv: Optional[list[str]] = None) -> int:
    """Hold a local multi-node cluster until SIGINT/SIGTERM (see cluster/local-cluster.sh)."""
    import argparse
    import json
    import signal
    import threading

    p = argparse.ArgumentParser(prog="python -m memckpt.runtime.tools.local_cluster",
                                description=main.__doc__)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--cpus-per-node", type=int, default=2)
    p.add_argument("--object-store-mb", type=int, default=256)
    p.add_argument("--dashboard-port", type=int, default=8265,
                   help="the dashboard's (job submission's) port; 0: any free port (see the "
                        "ready file's dashboard_url)")
    p.add_argument("--ready-file",
                   help="write {address, dashboard_url, nodes, temp_dir} here when up")
    p.add_argument("--temp-dir", help="the cluster's Ray temp dirs (and logs) go under this "
                   "folder (a short path); default: a new one under /tmp")
    a = p.parse_args(argv)
    if a.nodes < 1 or a.cpus_per_node < 1:
        p.error("--nodes and --cpus-per-node must be >= 1")
    if not 0 <= a.dashboard_port < 65536:
        p.error(f"--dashboard-port must be a TCP port (1-65535, or 0 for any free one), "
                f"not {a.dashboard_port}")
    try:
        if a.temp_dir:
            checked_temp_dir(a.temp_dir)
    except ValueError as e:
        p.error(f"--temp-dir: {e}")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    c = LocalCluster(a.nodes, a.cpus_per_node, a.object_store_mb, connect=False, dashboard=True,
                     dashboard_port=a.dashboard_port, temp_dir=a.temp_dir)
    info = {"address": c.address, "dashboard_url": c.dashboard_url, "nodes": list(c.nodes),
            "temp_dir": c.temp_dir}
    print(json.dumps(info), flush=True)
    if a.ready_file:
        write_atomic(Path(a.ready_file), json.dumps(info).encode())
    try:
        stop.wait()
    finally:
        c.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
