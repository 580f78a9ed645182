"""``memckpt bench compare --peers torchft,dlrover``: memckpt beside the fault-tolerance peers a
user would weigh it against, on one model, one data order, AdamW and the same seeds, in one run.

Every method trains the same MLP (:mod:`.peer_worker`) on 2 ranks of this machine, data
parallel over gloo, and is run three times: uninterrupted (the reference, and the per-step
figures), with rank 1 SIGKILLed after the forward pass of ``kill_step``, and with the whole job
SIGKILLed at ``job_kill_step`` (every process of the job, helpers included):

  none     the harness without checkpoints: the baseline of the RAM figure
  memckpt  ``memckpt.Checkpointer`` (the single-process API), snapshot every step into shared
           memory; the bench restarts every rank, as torchrun would; each restores from RAM
  dlrover  DLRover flash checkpoint ``DdpCheckpointer``, ``StorageType.MEMORY`` every step, in
           the mode without ``dlrover-run`` (its saver is a daemon process of local rank 0);
           the bench restarts every rank, as torchrun would
  torchft  torchft ``Manager`` with 2 replica groups of 1 rank over ``ProcessGroupGloo``, a
           lighthouse the bench starts, ``PGTransport`` (train_ddp.py); only the killed group
           is restarted and heals from the live one; torchft keeps no copy of its own, so it
           has no restore after the whole job is killed

The figures (rows ``benchmark="peers"``): the blocking part of the per-step call (memckpt:
``step()``; DLRover: ``save_checkpoint``; torchft: ``should_commit``), the time until the copy
is usable, host RAM held per GiB of state; after the kill, the time to the survivors' next step
and to the first step with every rank, the steps lost, and whether the final parameters and
optimizer state equal the uninterrupted run's bit for bit (computed).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import shutil
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from memckpt.bench.compare.peer_jobs import RANKS, Lighthouse, run_job
from memckpt.bench.compare.peer_rows import method_rows, missing_row, per_step
from memckpt.errors import ConfigError

PEERS = ("torchft", "dlrover")
DISTRIBUTIONS = {"torchft": "torchft", "dlrover": "dlrover"}
MODULES = {"torchft": ("torchft", "torchft.coordination"),
           "dlrover": ("dlrover.trainer.torch.flash_checkpoint.ddp",)}


@dataclass(frozen=True)
class TorchftSettings:
    """torchft's settings the times depend on; the defaults are its recommended ones (README:
    ``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``; the
    lighthouse's own heartbeat timeout 5 s; train_ddp.py: gloo timeout 5 s, PGTransport 10 s,
    Manager timeout 30 s; the Manager's heartbeat every 100 ms)."""

    min_replicas: int = 1
    quorum_tick_ms: int = 100
    join_timeout_ms: int = 10_000
    heartbeat_timeout_ms: int = 5_000
    heartbeat_ms: int = 100
    pg_timeout_s: float = 5.0
    transport_timeout_s: float = 10.0
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        for k, v in asdict(self).items():
            if not v > 0:
                raise ConfigError(f"TorchftSettings.{k}={v}: use a value > 0")


@dataclass(frozen=True)
class PeerSettings:
    """What ``--peers`` measures: state per rank (params + AdamW moments), steps, the kills."""

    state_bytes: int = 64 * 2**20
    size_label: str = "64M"
    steps: int = 40
    kill_step: int = 10  # rank 1 SIGKILLed after this step's forward pass
    job_kill_step: int = 10  # the whole job SIGKILLed (a separate run)
    step_s: float = 0.5  # each step's forward+backward lasts this long (padded by a sleep)
    batch: int = 16
    seed: int = 0
    whole_job: bool = True
    timeout_s: float = 600.0  # per job
    torchft: TorchftSettings = field(default_factory=TorchftSettings)

    def __post_init__(self) -> None:
        if self.steps < 4:
            raise ConfigError(f"PeerSettings.steps={self.steps}: use 4 or more")
        for k in ("kill_step", "job_kill_step"):
            if not 2 <= getattr(self, k) < self.steps:
                raise ConfigError(f"PeerSettings.{k}={getattr(self, k)}: use 2 .. steps-1 "
                                  f"({self.steps - 1})")
        if not self.step_s >= 0:
            raise ConfigError(f"PeerSettings.step_s={self.step_s}: use seconds >= 0")
        if self.state_bytes < 2**16:
            raise ConfigError(f"PeerSettings.state_bytes={self.state_bytes}: use 64K or more")


def _import_module(name: str) -> Any:
    """The one place a peer is imported (a test makes it fail to simulate a missing peer)."""
    return importlib.import_module(name)


def peer_status(peers: tuple[str, ...]) -> dict[str, Optional[str]]:
    """Per peer: None if it imports, else why not (to name in the output)."""
    out: dict[str, Optional[str]] = {}
    for p in peers:
        if p not in PEERS:
            out[p] = f"unknown peer (choose from {','.join(PEERS)})"
            continue
        try:
            for m in MODULES[p]:
                _import_module(m)
            out[p] = None
        except Exception as e:  # noqa: BLE001 (anything an import raises makes it unusable)
            out[p] = (f"cannot import {m}: {type(e).__name__}: {e} (pip install "
                      f"'memckpt[peers]')")
    return out


def version_of(peer: str) -> Optional[str]:
    try:
        return importlib.metadata.version(DISTRIBUTIONS[peer])
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown"


# -- the run ----------------------------------------------------------------------------------
def _clean(job: str, ram: Path) -> None:
    """Remove what a job left in RAM: memckpt's folder, DLRover's shared memory and sockets
    (named after the job by TORCHELASTIC_RUN_ID)."""
    shutil.rmtree(ram / job, ignore_errors=True)
    for f in Path("/dev/shm").glob(f"{job}_*"):
        f.unlink(missing_ok=True)
    shutil.rmtree(Path("/tmp/ckpt_sock") / job, ignore_errors=True)


def _method_runs(method: str, s: PeerSettings, base: dict[str, Any], tmp: Path,
                 log: Callable[[str], None]) -> dict[str, Any]:
    """The runs of one method; each run's events or the error that stopped it."""
    restart = "one" if method == "torchft" else "all"
    runs: dict[str, Any] = {}
    plan = [("reference", {}), ("kill", {"kill_step": s.kill_step})]
    if s.whole_job and method in ("memckpt", "dlrover"):
        plan.append(("job_kill", {"job_kill_step": s.job_kill_step}))
    if method == "none":
        plan = plan[:1]
    for name, extra in plan:
        lighthouse = None
        spec = dict(base, job=f"memckpt-peers-{uuid.uuid4().hex[:8]}", **extra)
        spec["ram_dir"] = base["ram_root"]  # memckpt's files go under ram_dir/job
        spec["disk_dir"] = str(tmp / "disk" / spec["job"])
        t0 = time.time()
        try:
            if method == "torchft":
                lighthouse = Lighthouse(tmp / method / name, asdict(s.torchft))
                spec["lighthouse"] = lighthouse.address
            events, job = run_job(method, tmp / method / name, spec, restart, s.timeout_s)
            runs[name] = {"events": events, "dir": tmp / method / name,
                          "restarts": job.restarts, "late": job.late,
                          "failed_starts": job.failed_starts}
            log(f"peers: {method} {name}: {time.time() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 (a failed peer is reported, the rest runs)
            runs[name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"peers: {method} {name} failed: {runs[name]['error']}")
        finally:
            if lighthouse is not None:
                lighthouse.shutdown()
            _clean(spec["job"], Path(base["ram_root"]))
    return runs


def run_peers(peers: tuple[str, ...], s: PeerSettings = PeerSettings(),
              log: Callable[[str], None] = print, directory: Optional[str] = None,
              keep: bool = False) -> list[dict[str, Any]]:
    """Measure memckpt and each available peer in ``peers``; the rows (see :mod:`.peer_rows`).
    A peer that does not import or does not start gets a row that says why. ``keep``: leave
    the runs' logs (in a temp folder under ``directory``) for a look."""
    from memckpt.bench.compare.peer_worker import LAYERS, width_for  # torch: not at start-up
    status = peer_status(peers)
    width = width_for(s.state_bytes)
    state_bytes = 3 * 4 * LAYERS * (width * width + width)
    base = {"seed": s.seed, "width": width, "batch": s.batch, "steps": s.steps, "step_s": s.step_s,
            "world": RANKS, "kill_rank": 1, "measure_usable": True, "torchft": asdict(s.torchft),
            "linger_s": 120}
    tmp = Path(tempfile.mkdtemp(prefix="memckpt-peers-", dir=directory))
    (tmp / "ram").mkdir()
    # shared memory for memckpt's snapshots (DLRover's go to /dev/shm by its own naming)
    ram_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp / "ram"
    ram = Path(tempfile.mkdtemp(prefix="memckpt-peers-", dir=ram_root))
    rows: list[dict[str, Any]] = []
    common = {"size": s.size_label, "state_bytes": state_bytes, "cpu_model": cpu_model(),
              "settings": {"steps": s.steps, "kill_step": s.kill_step, "step_s": s.step_s,
                           "job_kill_step": s.job_kill_step, "batch": s.batch, "seed": s.seed,
                           "width": width, "layers": LAYERS, "ranks": RANKS}}
    try:
        results = {}
        for method in ("none", "memckpt") + tuple(p for p in peers if status.get(p) is None):
            results[method] = _method_runs(method, s, dict(base, ram_root=str(ram)), tmp, log)
        none = results.get("none", {}).get("reference", {})
        base_anon = per_step(none["events"])["anon_bytes"] if "events" in none else None
        for method, runs in results.items():
            if method != "none":
                rows += method_rows(method, runs, base_anon, common,
                                    asdict(s.torchft) if method == "torchft" else None,
                                    version_of)
        for p in peers:
            if status.get(p) is not None:
                rows.append(missing_row(p, str(status[p]), common))
    finally:
        if keep:
            log(f"peers: the runs' logs are kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(ram, ignore_errors=True)
    return rows
