"""End to end as a user runs it: a real head with its dashboard on loopback (held by
``python -m memckpt.runtime.tools.local_cluster`` in its own process), jobs submitted with
``ray job submit``, drills from other processes with ``memckpt status`` / ``kill``."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from conftest import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.chaos, pytest.mark.timeout(900)]

JOB_PY = """from memckpt.demo.job import GPTJob
train = GPTJob(steps={steps}, size="tiny", seed=3, step_delay_s={delay})
"""
# The first generation waits before snapshotting step {hold} until the test writes
# {release}: a drill from another terminal always lands while the job trains.
HELD_JOB_PY = """import os, time
from memckpt.demo.job import GPTJob


class _Held:
    def __init__(self, ctx):
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def step(self, state, step, **metrics):
        while self._ctx.generation == 0 and step == {hold} and not os.path.exists({release!r}):
            time.sleep(0.1)
        return self._ctx.step(state, step, **metrics)


def train(ctx):
    return GPTJob(steps={steps}, size="tiny", seed=3)(_Held(ctx))
"""
CONFIG_PY = """import memckpt
config = memckpt.Config(
    job_name={name!r},
    workers=memckpt.WorkersConfig(num_workers=3, cpus_per_worker=1),
    placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
    failure=memckpt.FailureConfig(heartbeat_interval_s=0.25, heartbeat_timeout_s=2.0,
                                  max_restarts={max_restarts}, collective_timeout_s=30.0),
    chaos={chaos},
)
"""


@contextmanager
def local_cluster_process(d: Path, nodes: int):
    """A local cluster held by ``python -m memckpt.runtime.tools.local_cluster`` (as
    cluster/local-cluster.sh runs it), its dashboard on any free port (the session's
    cluster runs too), logs in ``d``; yields its ready file's info and the environment to
    reach it with. Stopped on exit, also when it failed to start."""
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    log = open(d / "cluster.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "memckpt.runtime.tools.local_cluster",
                             "--nodes", str(nodes), "--dashboard-port", "0",
                             "--ready-file", str(d / "ready.json")],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        def up() -> bool:
            assert proc.poll() is None, (d / "cluster.log").read_text()[-3000:]
            return (d / "ready.json").exists()

        wait_for(up, 120, "the local cluster to come up", interval=0.2)
        info = json.loads((d / "ready.json").read_text())
        info["env"] = env
        pings: list[subprocess.CompletedProcess] = []

        def agent_up() -> bool:  # the head's job agent comes up after the cluster
            pings.append(subprocess.run(["ray", "job", "submit", "--address",
                                         info["dashboard_url"], "--", "python", "-c",
                                         "print('ready')"], env=env, capture_output=True,
                                        text=True, timeout=120))
            return pings[-1].returncode == 0

        # on a loaded machine the job agent can take minutes: wait for a trivial job
        wait_for(agent_up, 300, lambda: "a trivial job to run: "
                 + pings[-1].stdout[-2000:] + pings[-1].stderr[-2000:], interval=2)
        yield info
    finally:  # also when start-up failed: never leak a cluster
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    with local_cluster_process(tmp_path_factory.mktemp("head"), nodes=3) as info:
        yield info


def job_dir(tmp_path: Path, name: str, steps: int = 12, delay: float = 0.0, chaos: str = "()",
            max_restarts: int = 3, job_py: str = "") -> Path:
    wd = tmp_path / name
    wd.mkdir()
    (wd / "job.py").write_text(job_py or JOB_PY.format(steps=steps, delay=delay))
    (wd / "config.py").write_text(CONFIG_PY.format(name=name, chaos=chaos,
                                                   max_restarts=max_restarts))
    return wd


def submit(head, wd: Path, summary: Path, wait: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ray", "job", "submit", "--address", head["dashboard_url"], "--working-dir", str(wd)]
    if not wait:
        cmd.append("--no-wait")
    cmd += ["--", "memckpt", "run", "job.py:train", "--config", "config.py",
            "--summary", str(summary), "--run-dir", str(summary.with_suffix(".run"))]
    return subprocess.run(cmd, env=head["env"], capture_output=True, text=True, timeout=600)


def job_status(head, job_id: str) -> str:
    res = subprocess.run(["ray", "job", "status", "--address", head["dashboard_url"], job_id],
                         env=head["env"], capture_output=True, text=True, timeout=60)
    out = res.stdout + res.stderr
    for state in ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING"):
        if state.lower() in out.lower():
            return state
    return out


def test_submitted_job_recovers_and_matches_reference(head, tmp_path):
    ref = submit(head, job_dir(tmp_path, "ref"), tmp_path / "ref.json")
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    chaos = "(memckpt.ChaosEvent(step=6, target='worker', rank=1, signal='KILL'),)"
    drill = submit(head, job_dir(tmp_path, "drill", chaos=chaos), tmp_path / "drill.json")
    assert drill.returncode == 0, drill.stdout[-3000:] + drill.stderr[-3000:]
    assert "succeeded" in (drill.stdout + drill.stderr).lower()
    assert "failure detected" in drill.stdout  # the job's logs stream to the submitter
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("ref.json", "drill.json"))
    assert len(b["recoveries"]) == 1 and b["recoveries"][0]["died_ranks"] == [1]
    assert b["losses"] == a["losses"] and b["final_digest"] == a["final_digest"]


def test_impossible_recovery_fails_the_job_with_the_reason(head, tmp_path):
    chaos = "(memckpt.ChaosEvent(step=4, target='worker', rank=0, signal='KILL'),)"
    res = submit(head, job_dir(tmp_path, "give-up", chaos=chaos, max_restarts=0),
                 tmp_path / "s.json")
    assert res.returncode != 0
    assert "gave up after 0 recoveries" in res.stdout + res.stderr
    assert "failure.max_restarts" in res.stdout + res.stderr


def test_status_and_kill_from_another_terminal(head, tmp_path):
    release = tmp_path / "release"
    wd = job_dir(tmp_path, "drill-cli", job_py=HELD_JOB_PY.format(
        steps=12, hold=6, release=str(release)))
    res = submit(head, wd, tmp_path / "cli.json", wait=False)
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"raysubmit_[A-Za-z0-9]+", res.stdout + res.stderr).group(0)
    memckpt = [sys.executable, "-m", "memckpt.cli"]
    started = time.monotonic()
    statuses: list[subprocess.CompletedProcess] = []

    def training() -> bool:
        st = subprocess.run(memckpt + ["status", "--job", "drill-cli", "--address",
                                       head["address"], "--json"],
                            env=head["env"], capture_output=True, text=True, timeout=60)
        statuses.append(st)
        if st.returncode != 0:
            return False
        s = json.loads(st.stdout)
        # and a node's store measured its memckpt files (every few seconds, with a heartbeat)
        return s["committed"] not in (None, 0) and any(
            r["held"] > 0 for r in (s.get("node_ram") or {}).values())

    wait_for(training, 180, lambda: "the job to train: " + statuses[-1].stdout
             + statuses[-1].stderr, interval=1)
    try:
        human = subprocess.run(memckpt + ["status", "--job", "drill-cli", "--address",
                                          head["address"]], env=head["env"], capture_output=True,
                               text=True, timeout=60)
        assert "placement" in human.stdout and "rank 2" in human.stdout
        # each node's memckpt host RAM against its budget (#50), some of it held
        held = re.findall(r"node \S+: RAM held ([\d.]+) \S+ of budget [\d.]+ \S+ \(\d+%\)",
                          human.stdout)
        assert held and any(float(x) > 0 for x in held), human.stdout
        # every rank's own step and last sign of life, asked of its node's store (#51: the
        # coordinator keeps one record a node)
        each = subprocess.run(memckpt + ["status", "--job", "drill-cli", "--address",
                                         head["address"], "--ranks"], env=head["env"],
                              capture_output=True, text=True, timeout=60)
        found = re.findall(r"  rank (\d+) on \S+: step (-?\d+), last sign of life [\d.]+s ago",
                           each.stdout)
        assert sorted(int(r) for r, _ in found) == [0, 1, 2], each.stdout + each.stderr
        assert all(int(step) >= 1 for _, step in found), each.stdout
        kill = subprocess.run(memckpt + ["kill", "--worker", "2", "--job", "drill-cli", "--address",
                                         head["address"]], env=head["env"], capture_output=True,
                              text=True, timeout=60)
        assert kill.returncode == 0 and "SIGKILL to rank 2" in kill.stdout, kill.stderr
    finally:  # the job held its step 6 for this drill: let it go on
        release.write_text("go")
    wait_for(lambda: job_status(head, job_id) not in ("RUNNING", "PENDING"),
             480 - (time.monotonic() - started), f"job {job_id} to end", interval=2)
    assert job_status(head, job_id) == "SUCCEEDED"
    summary = json.loads((tmp_path / "cli.json").read_text())
    assert [r["died_ranks"] for r in summary["recoveries"]] == [[2]]
    bad = subprocess.run(memckpt + ["kill", "--worker", "9", "--job", "no-such-job",
                                    "--address", head["address"]], env=head["env"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "no running memckpt job named 'no-such-job'" in bad.stderr


_ANY = {"0.0.0.0", "::"}  # a wildcard listener would take the node address's connections too


def _agent_owners(clusters: set[str]) -> dict[int, tuple[str, int, list[int]]]:
    """Every raylet of the ``clusters`` (GCS addresses) on this machine -> (its cluster, its
    agent's port, the pids listening where that raylet sends its runtime-env requests).

    The raylet dials its node's address at the port its runtime-env agent published, and the
    agent binds that address alone; so the holders are the listeners on that address or a
    wildcard at that port. A listener on another address (the dashboard's on 127.0.0.1) may
    hold the same port number: Linux hands out a port to ``bind(address, 0)`` that another
    address already uses, and no request of this raylet reaches it (a CI run met one)."""
    import psutil
    from ray._raylet import RUNTIME_ENV_AGENT_PORT_NAME, get_port_filename
    listeners: dict[tuple[str, int], list[int]] = {}
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.pid:
            ip = c.laddr.ip.removeprefix("::ffff:")  # an IPv4 address on a dual-stack socket
            listeners.setdefault((ip, c.laddr.port), []).append(c.pid)
    out = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] != "raylet":
            continue
        args = dict(a[2:].split("=", 1) for a in p.info["cmdline"][1:] if "=" in a)
        if args.get("gcs-address") not in clusters:
            continue  # another cluster on this machine (another project's)
        port_file = Path(args["session_dir"]) / get_port_filename(args["node_id"],
                                                                   RUNTIME_ENV_AGENT_PORT_NAME)
        port = int(port_file.read_text())
        dialled = {args["node_ip_address"]} | _ANY
        out[p.pid] = (args["gcs-address"], port,
                      [pid for (ip, at), pids in listeners.items() if at == port and ip in dialled
                       for pid in pids])
    return out


def _described(pids: list[int]) -> list[str]:
    """Each pid with its parent and command line, for a failure's message."""
    import psutil
    out = []
    for pid in pids:
        try:
            q = psutil.Process(pid)
            out.append(f"{pid} (parent {q.ppid()}): {' '.join(q.cmdline())[:300]}")
        except psutil.NoSuchProcess:
            out.append(f"{pid} (gone)")
    return out


def _ppid(pid: int) -> int:
    import psutil
    try:
        return psutil.Process(pid).ppid()
    except psutil.NoSuchProcess:
        return -1


def test_two_local_clusters_keep_their_own_agents(head, cluster):
    """The job-submission head (its own process) and the session's cluster side by side:
    each raylet's runtime-env agent port is held by that raylet's own agent and nothing
    else, so no raylet can send a job's runtime env to the other cluster's agent."""
    import socket

    import psutil
    owners = _agent_owners({head["address"], cluster.address})
    assert len({c for c, _, _ in owners.values()}) == 2 and len(owners) == 8, owners  # 2 x (head + 3)
    # the port number held on another address, as Linux may hand it out: not a holder
    raylet, (_, port, _) = next(iter(owners.items()))
    if cluster.address.split(":")[0] != "127.0.0.1":
        with socket.socket() as other:
            other.bind(("127.0.0.1", port))
            other.listen()
            assert os.getpid() not in _agent_owners({head["address"], cluster.address})[raylet][2]
    for raylet, (_, _, pids) in owners.items():
        # its agent, and any process the agent started meanwhile that inherited the socket
        # (psutil lists every holder of the listening socket): all under this raylet
        under = []
        for pid in pids:
            try:
                under.append(raylet in [q.pid for q in psutil.Process(pid).parents()])
            except psutil.NoSuchProcess:
                pass  # gone: it holds no port
        assert under and all(under), (raylet, _described(pids))
        assert any(_ppid(pid) == raylet for pid in pids), (raylet, _described(pids))  # its agent


PROBE_PY = """import time

import ray

time.sleep(3)  # an entrypoint that starts slowly (a loaded machine importing torch)
ray.init()
print("JOINED", ray.get_runtime_context().gcs_address)


@ray.remote(num_cpus=1)
def where():
    return ray.get_runtime_context().get_node_id()


print("NODES", " ".join(sorted(set(ray.get([where.remote() for _ in range(6)])))))
"""


def test_a_job_runs_on_the_cluster_it_was_submitted_to(head, tmp_path):
    """A second local cluster starts after the job's own one, so it is the newest on the
    machine. A job submitted to the older one, whose entrypoint starts slowly, joins the GCS
    of the cluster it was submitted to and runs its tasks on that cluster's nodes only. (Ray
    hands the entrypoint a RAY_ADDRESS it resolved from "auto": the newest cluster recorded
    in the head's temp dir, which under one temp dir shared by both was the other one.)"""
    newer = tmp_path / "newer"
    newer.mkdir()
    with local_cluster_process(newer, nodes=1) as other:
        wd = tmp_path / "probe"
        wd.mkdir()
        (wd / "probe.py").write_text(PROBE_PY)
        res = subprocess.run(["ray", "job", "submit", "--address", head["dashboard_url"],
                              "--working-dir", str(wd), "--", "python", "probe.py"],
                             env=head["env"], capture_output=True, text=True, timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    joined = re.search(r"^JOINED (\S+)$", out, re.M)
    ran_on = re.search(r"^NODES (.+)$", out, re.M)
    assert joined and joined.group(1) == head["address"] != other["address"], out[-3000:]
    assert ran_on and set(ran_on.group(1).split()) <= set(head["nodes"]), (out[-3000:], head)


def _session_dirs(gcs_address: str) -> list[str]:
    """The session folder of every raylet of the cluster at ``gcs_address``."""
    import psutil
    dirs = []
    for p in psutil.process_iter(["name", "cmdline"]):
        if p.info["name"] == "raylet":
            args = dict(a[2:].split("=", 1) for a in p.info["cmdline"][1:] if "=" in a)
            if args.get("gcs-address") == gcs_address:
                dirs.append(args["session_dir"])
    return dirs


SHORT_JOB_PY = """from memckpt.demo.job import GPTJob

train = GPTJob(steps=3, size="tiny", seed=0)
"""
SHORT_CONFIG_PY = """import memckpt

config = memckpt.Config(
    job_name="wd",
    workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
    placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
    failure=memckpt.FailureConfig(warm_spares=False),
)
"""
# What a memckpt job's actors do first, on every node at once: import memckpt (the
# coordinator, the stores) from the job's unpacked working directory.
IMPORT_PROBE_PY = """import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init()


@ray.remote(num_cpus=1)
class Importer:
    def where(self):
        import memckpt.persist.catalog  # noqa: F401 (the import that failed)
        import memckpt.runtime.coordinator.coordinator  # noqa: F401
        import memckpt.runtime.node.replica_store  # noqa: F401
        import memckpt
        return ray.get_runtime_context().get_node_id(), memckpt.__file__


nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("CPU")]
actors = [Importer.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False))
          .remote() for n in nodes]
for node, path in ray.get([a.where.remote() for a in actors]):
    print("IMPORTED", node, path)
"""


def test_working_dir_jobs_submitted_ten_times_in_a_row_all_succeed(head, tmp_path):
    """The README's flow (``ray job submit --working-dir . -- memckpt run ...``) on a 3-node
    local cluster: the coordinator, the stores and the ranks on every node import memckpt
    from the job's unpacked working directory (the checkout's ``memckpt/``). Each node
    unpacks it under its own Ray temp dir. When the nodes shared one folder, their agents
    removed and extracted the same package there while an actor started through another
    agent imported from it, and about one job in four failed at start.

    The example job runs once (shortened to 3 tiny steps); then ten submissions in a row of
    the same working directory start an actor on every node at once that imports memckpt's
    coordinator and store from it (what the failed jobs' actors did first): every one
    succeeds, each node imports from a folder of its own. (Ten whole jobs would cost this
    suite 4-7 minutes on a 2-core machine for the same few seconds at start.)"""
    dirs = _session_dirs(head["address"])
    assert len(dirs) == 4 and len(set(dirs)) == 4, dirs  # head + 3 nodes, each its own
    repo = Path(__file__).resolve().parents[1]
    wd = tmp_path / "checkout"
    shutil.copytree(repo / "memckpt", wd / "memckpt",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (wd / "job.py").write_text(SHORT_JOB_PY)
    (wd / "config.py").write_text(SHORT_CONFIG_PY)
    (wd / "probe.py").write_text(IMPORT_PROBE_PY)

    def submit_wd(*entrypoint: str) -> str:
        res = subprocess.run(["ray", "job", "submit", "--address", head["dashboard_url"],
                              "--working-dir", str(wd), "--", *entrypoint],
                             env=head["env"], capture_output=True, text=True, timeout=600)
        out = res.stdout + res.stderr
        assert res.returncode == 0 and "succeeded" in out.lower(), out[-3000:]
        return out

    submit_wd("memckpt", "run", "job.py:train", "--config", "config.py",
              "--summary", str(tmp_path / "wd.json"))
    assert len(json.loads((tmp_path / "wd.json").read_text())["losses"]) == 3
    # the probes through Ray's job SDK, the REST calls `ray job submit` makes (one CLI
    # process less each)
    from ray.job_submission import JobStatus, JobSubmissionClient
    client = JobSubmissionClient(head["dashboard_url"])
    for i in range(10):
        job = client.submit_job(entrypoint="python probe.py", runtime_env={"working_dir": str(wd)})
        ended = wait_for(lambda: client.get_job_status(job) in (JobStatus.SUCCEEDED,
                                                                JobStatus.FAILED,
                                                                JobStatus.STOPPED) and
                         client.get_job_status(job), 300, f"probe {i} to end", interval=0.5)
        out = client.get_job_logs(job)
        assert ended == JobStatus.SUCCEEDED, (i, ended, client.get_job_info(job).message,
                                              out[-3000:])
        imported = dict(line.split()[1:3] for line in out.splitlines()
                        if line.startswith("IMPORTED "))
        assert set(imported) == set(head["nodes"]), (i, out[-3000:])
        folders = {str(Path(path).parent.parent) for path in imported.values()}
        assert len(folders) == 3, (i, imported)  # no two nodes import from one folder
        assert all("/runtime_resources/working_dir_files/" in path and
                   any(path.startswith(d + "/") for d in dirs)
                   for path in imported.values()), (i, imported, dirs)
