"""The jobs of ``memckpt bench compare --peers``: start the ranks of one method as processes
(:mod:`.peer_worker`), restart them after a kill the way each method's launcher does, and read
back what they logged. No figures are derived here (see :mod:`.peers`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import memckpt

RANKS = 2
LATE_S = 5.0
MAX_RESTARTS = 3
GRACE_S = 5.0  # SIGTERM, then SIGKILL after this (as torchelastic stops the other workers)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Job:
    """The processes of one run of one method; ``events`` once :meth:`wait` returned."""

    method: str
    folder: Path
    spec: dict[str, Any]
    timeout_s: float
    procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict)
    incarnation: int = 0
    pgid: Optional[int] = None  # every process of the job is in one group (for a job kill)
    restarts: list[dict[str, Any]] = field(default_factory=list)
    groups: set[int] = field(default_factory=set)  # every process group the job made
    failed_starts: list[str] = field(default_factory=list)  # restarts that failed, why
    late: list[int] = field(default_factory=list)  # restarted ranks stopped at the end
    survivors_done: float = 0.0

    def start(self, ranks: range | list[int], restarted: bool = False) -> None:
        env = dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(
                       [str(Path(memckpt.__file__).resolve().parent.parent)] +
                       [p for p in [os.environ.get("PYTHONPATH")] if p]),
                   # DLRover: its sockets and shared memory named for this job alone
                   TORCHELASTIC_RUN_ID=self.spec["job"], LOCAL_WORLD_SIZE=str(RANKS),
                   WORLD_SIZE=str(RANKS), GROUP_WORLD_SIZE="1", GROUP_RANK="0")
        if self.method != "torchft":
            self.spec["port"] = free_port()
        for rank in ranks:
            spec = dict(self.spec, rank=rank, restarted=restarted,
                        log=str(self.folder / f"{self.method}-{self.incarnation}-r{rank}.jsonl"),
                        out=str(self.folder / f"{self.method}-r{rank}.pt"))
            out = open(self.folder / f"{self.method}-{self.incarnation}-r{rank}.out", "wb")
            env_r = dict(env, RANK=str(rank), LOCAL_RANK=str(rank))
            p = subprocess.Popen([sys.executable, "-m", "memckpt.bench.compare.peer_worker",
                                  json.dumps(spec)], env=env_r, stdout=out,
                                 stderr=subprocess.STDOUT, process_group=self.pgid or 0)
            out.close()
            if self.pgid is None:
                self.pgid = p.pid
                self.groups.add(p.pid)
            self.procs[rank] = p
        self.incarnation += 1

    def _stop(self, ranks: list[int]) -> None:
        for r in ranks:
            if self.procs[r].poll() is None:
                self.procs[r].send_signal(signal.SIGTERM)
        deadline = time.time() + GRACE_S
        for r in ranks:
            try:
                self.procs[r].wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.procs[r].kill()
                self.procs[r].wait()

    def wait(self, restart: str) -> None:
        """Until every rank exits 0. A rank killed by SIGKILL is restarted: ``restart="all"``
        stops the others and restarts every rank (torchrun / dlrover-run); ``"one"`` restarts
        only it (a torchft replica group); a whole-job kill restarts every rank."""
        deadline = time.time() + self.timeout_s
        while True:
            codes = {r: p.poll() for r, p in self.procs.items() if r not in self.late}
            done = {r for r in codes if (self.folder / f"{self.method}-r{r}.pt").exists()}
            if done == set(codes):
                Path(self.spec["stop_file"]).touch()
            elif restart == "one" and self._restarted_late(done, set(codes)):
                continue
            if all(c == 0 for c in codes.values()):
                return
            killed = [r for r, c in codes.items() if c == -signal.SIGKILL]
            failed = [r for r, c in codes.items() if c not in (None, 0, -signal.SIGKILL)]
            if failed and not killed:
                why = f"rank {failed[0]} exited with {codes[failed[0]]}: {self.tail(failed[0])}"
                if restart != "all" or len(self.failed_starts) >= MAX_RESTARTS:
                    raise RuntimeError(f"{self.method}: {why}")
                # a rank that fails (to start): restart every rank (torchrun --max-restarts)
                self.failed_starts.append(why)
                killed = failed
            if killed:
                now = time.time()
                # after a failed start before the kill, the kill is still to come
                after = self.killed()
                if restart == "one" and len(killed) < len(codes):
                    self.restarts.append({"t": now, "ranks": killed})
                    self.start(killed, restarted=after)
                else:
                    self._stop(list(codes))
                    self.restarts.append({"t": now, "ranks": list(codes)})
                    self.pgid = None
                    self.start(range(RANKS), restarted=after)
            if time.time() > deadline:
                self.kill()
                raise TimeoutError(f"{self.method}: not done after {self.timeout_s:.0f} s "
                                   f"({self.folder})")
            time.sleep(0.01)

    def _restarted_late(self, done: set[int], ranks: set[int]) -> bool:
        """torchft: the ranks never killed finished, and a restarted one has not finished
        within ``LATE_S`` of that: it came back too late to rejoin within this run's steps
        (on its own it would train from step 0 again). Stop it; :attr:`late` names it."""
        restarted = {r for x in self.restarts for r in x["ranks"]}
        if not done or not (ranks - restarted) <= done:
            return False
        self.survivors_done = self.survivors_done or time.time()
        if time.time() - self.survivors_done < LATE_S:
            return False
        for r in ranks - done:
            self.procs[r].kill()
            self.procs[r].wait()
            self.late.append(r)
        return True

    def killed(self) -> bool:
        """Whether a rank has logged its kill (``kill`` or ``job_kill``) yet."""
        return any(e["event"] in ("kill", "job_kill") for e in self.events())

    def tail(self, rank: int) -> str:
        outs = sorted(self.folder.glob(f"{self.method}-*-r{rank}.out"))
        lines = (outs[-1].read_text(errors="replace") if outs else "").strip().splitlines()
        errors = [ln for ln in lines if "Error" in ln or "Exception" in ln]
        # the first error raised (a later one is often a destructor's after it)
        return (errors[0] if errors else lines[-1] if lines else "(no output)")[-300:]

    def kill(self) -> None:
        """SIGKILL every process this job started, its helpers (DLRover's saver) included."""
        for g in self.groups:
            try:
                os.killpg(g, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def events(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for f in sorted(self.folder.glob(f"{self.method}-*-r*.jsonl")):
            inc = int(f.name.split("-")[-2])
            for line in f.read_text().splitlines():
                try:
                    out.append(dict(json.loads(line), incarnation=inc))
                except ValueError:
                    pass  # a line cut by the kill
        return sorted(out, key=lambda e: e["t"])


def run_job(method: str, folder: Path, spec: dict[str, Any], restart: str,
            timeout_s: float) -> tuple[list[dict[str, Any]], Job]:
    """Run one job of ``method`` to its end; its events, and the job (restarts, outputs)."""
    folder.mkdir(parents=True, exist_ok=True)
    job = Job(method, folder, dict(spec, method=method, barrier_dir=str(folder / "barrier"),
                                   stop_file=str(folder / f"{method}.stop")), timeout_s)
    try:
        job.start(range(RANKS))
        job.wait(restart)
    finally:
        job.kill()
    return job.events(), job


class Lighthouse:
    """torchft's lighthouse in a process of its own (its log to ``folder``), as
    ``torchft_lighthouse`` runs it; ``address`` once started."""

    def __init__(self, folder: Path, settings: dict[str, Any], timeout_s: float = 120.0) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        code = ("import sys, time\n"
                "from torchft.coordination import LighthouseServer\n"
                f"s = LighthouseServer(bind='[::]:0', min_replicas={settings['min_replicas']}, "
                f"join_timeout_ms={settings['join_timeout_ms']}, "
                f"quorum_tick_ms={settings['quorum_tick_ms']}, "
                f"heartbeat_timeout_ms={settings['heartbeat_timeout_ms']})\n"
                "print(s.address(), flush=True)\n"
                "time.sleep(1e9)\n")
        with open(folder / "lighthouse.log", "wb") as err:
            self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                         stderr=err, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().decode().strip()  # blocks until it is up (or died)
        if not line:
            self.proc.wait(timeout_s)
            raise RuntimeError("torchft lighthouse did not start: " +
                               (folder / "lighthouse.log").read_text()[-300:])
        self.address = line

    def shutdown(self) -> None:
        self.proc.kill()
        self.proc.wait()
