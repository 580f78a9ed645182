"""The multi-node demo: 3 simulated nodes, a GPT (DDP + ZeRO, or FSDP2), a fault, recovery.

It starts a local Ray cluster of separate raylets (one per "node"), runs
:class:`~memckpt.demo.job.GPTJob` (or :class:`~memckpt.demo.job.FSDPJob`) with ring
placement, injects the chosen fault mid-run, and (unless ``compare`` is off) runs the
uninterrupted reference on the same cluster to show that losses and final parameters
are bit-identical.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional, TextIO

# What Ray's driver prints when a process or node it runs dies; during a drill that is the
# kill memckpt injected, which these notices would present as a crash (OOM killer, SIGSEGV).
DEATH_NOTICES = {
    "A worker died or was killed": "a worker process was killed",
    "has been marked dead because the detector has missed too many heartbeats":
        "a node was removed",
}


class _DrillNotices:
    """``sys.stdout`` while a drill runs: each of Ray's death notices becomes one line saying
    that this was the drill; everything else passes through."""

    def __init__(self, out: TextIO, fault: str) -> None:
        self._out, self.fault = out, fault

    def write(self, text: str) -> int:
        for marker, what in DEATH_NOTICES.items():
            if marker in text:
                text = (f"[memckpt demo] {what}: the drill's fault (--fault {self.fault}), "
                        "not a crash")
                break
        return self._out.write(text)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding, ...
        return getattr(self._out, name)


@contextmanager
def drill_notices(fault: str) -> Iterator[None]:
    """While the drill's run is in flight, Ray's notices of the death it causes read as the
    drill (Ray prints them from a background thread, to whatever ``sys.stdout`` is then)."""
    if fault == "none":
        yield
        return
    out = sys.stdout
    sys.stdout = _DrillNotices(out, fault)
    try:
        yield
    finally:
        sys.stdout = out


ELASTIC_GLOBAL_BATCH = 12  # 2 micro batches of 2 per rank at 3 ranks, 3 at 2
ELASTIC_ADD_AFTER_S = 3.0  # the elastic demo adds a node back this long after the loss
ELASTIC_STEP_DELAY_S = 0.3  # stretches its steps: the node is added while the job trains


def demo_config(job_name: str, nodes: int = 3, replicas: int = 1, persist: tuple = (),
                min_workers: Optional[int] = None):
    import memckpt
    return memckpt.Config(
        job_name=job_name,
        persistence=tuple(memckpt.PersistTier(uri, every=5, keep_last=2) for uri in persist),
        workers=memckpt.WorkersConfig(num_workers=nodes, workers_per_node=1, cpus_per_worker=1,
                                      min_workers=min_workers),
        placement=memckpt.PlacementConfig(strategy="ring", replicas=replicas),
        snapshot_every=1,
        failure=memckpt.FailureConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                      max_restarts=3, collective_timeout_s=60.0,
                                      replace_timeout_s=2.0,
                                      warm_spares=min_workers is None),
    )


ELASTIC_JOB = "demo-elastic"


def _elastic_demo(steps: int, kill_at: int, size: str, seed: int) -> dict:
    """3 one-rank nodes, no room to spare: a node dies, the job goes on with 2 ranks from
    RAM; a node is added back and the job grows to 3. ``memckpt report`` draws it."""
    import threading

    import memckpt
    from memckpt.demo.job import GPTJob
    from memckpt.runtime.driver.driver import default_run_dir
    from memckpt.runtime.chaos.faults import FaultInjector
    from memckpt.runtime.tools.local_cluster import local_cluster

    job = GPTJob(steps=steps, size=size, seed=seed, batch_size=2,
                 global_batch=ELASTIC_GLOBAL_BATCH, step_delay_s=ELASTIC_STEP_DELAY_S)
    run_dir = default_run_dir(ELASTIC_JOB)
    done: dict[str, Any] = {}
    with local_cluster(nodes=3, cpus_per_node=1) as cluster:
        inj = FaultInjector(node_killer=cluster.remove_node).kill_node(rank=1, at_step=kill_at)

        def train() -> None:
            try:
                done["result"] = memckpt.run(job, demo_config(ELASTIC_JOB, min_workers=2),
                                             run_dir=run_dir, injector=inj)
            except BaseException as e:  # noqa: BLE001 (re-raised in the main thread)
                done["error"] = e

        runner = threading.Thread(target=train, name="memckpt-demo-job")
        with drill_notices("node"):  # Ray's notice of the node's death reads as the drill
            runner.start()
            _add_node_back(runner, run_dir, cluster)
            runner.join()
    if "error" in done:
        raise done["error"]
    result = done["result"]
    result["run_dir"] = str(run_dir)
    result["step_s"] = step_time_s(run_dir)
    return result


def _add_node_back(runner: Any, run_dir: Path, cluster: Any) -> None:
    """Once the job has shrunk, wait a little and add a node with room for a rank."""
    import time
    # Ray adds nodes from the main thread only; the job runs in another
    while runner.is_alive() and not _resized(run_dir):
        time.sleep(0.2)
    if runner.is_alive():
        time.sleep(ELASTIC_ADD_AFTER_S)
        print("adding a node with room for a rank", flush=True)
        cluster.add_node()


def step_time_s(run_dir: Path) -> Optional[float]:
    """The median time between consecutive steps of one generation (``steps.jsonl``): what a
    training step of the demo's model takes on this machine."""
    path = run_dir / "steps.jsonl"
    if not path.exists():
        return None
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    gaps = sorted(b["time"] - a["time"] for a, b in zip(rows, rows[1:])
                  if a["gen"] == b["gen"] and b["step"] == a["step"] + 1)
    return gaps[len(gaps) // 2] if gaps else None


def recovery_lines(result: dict) -> list[str]:
    """The demo's closing lines: each recovery's phases, then the model's step time beside
    them, so the reader sees which part is memckpt's and which the model's own."""
    out = []
    for rec in result["recoveries"]:
        ph = rec["phases_s"]
        r = rec.get("resized") or {}
        planned = bool(r) and (r.get("to") or 0) > (r.get("from") or 0)
        head = (f"planned resize from {r['from']} to {r['to']} ranks after step "
                f"{rec['resumed_step']}" if planned else
                f"recovery from '{rec['what']}' (resumed at step {rec['resumed_step']}"
                + (f", {r['from']} -> {r['to']} ranks" if r else "") + ")")
        parts = " + ".join(f"{k} {ph[k]:.2f}" for k in ("detect", "stop", "plan", "resume")
                           if ph.get(k) is not None)
        # a planned resize has no fault: its recorded total starts at the resume, so the
        # line adds its phases instead
        shown = [ph[k] for k in ("stop", "plan", "resume") if ph.get(k) is not None]
        whole = sum(shown) if planned else ph.get("total")
        total = f"{whole:.1f} s = " if whole is not None else ""
        load = ph.get("fetch_and_load_max")
        out.append(f"{head}: {total}{parts} s"
                   + (f" (of the resume, loading the state from RAM: {load:.2f} s; the rest "
                      "is restarting workers, the process group and one training step)"
                      if load is not None and ph.get("resume") is not None else ""))
    step = result.get("step_s")
    if step is not None:
        out.append(f"for scale: one training step of this model takes {step:.2f} s here "
                   "(3 ranks sharing this machine's cores)")
    return out


def _resized(run_dir: Path) -> bool:
    path = run_dir / "events.jsonl"
    return path.exists() and '"event": "resized"' in path.read_text()


def injector_for(fault: str, kill_at: int, cluster) -> "Any":
    from memckpt.runtime.chaos.faults import FaultInjector
    inj = FaultInjector(node_killer=cluster.remove_node)
    # steady: the fault waits until every node's warm spare is up, as it is in a job past
    # its first minute; the demo's job is seconds old at the fault, its spares still starting
    if fault == "worker":
        inj.kill_worker(rank=1, at_step=kill_at, steady=True)
    elif fault == "node":
        inj.kill_node(rank=1, at_step=kill_at, steady=True)
    elif fault == "store":
        inj.kill_store(rank=1, at_step=kill_at)
    elif fault == "coordinator":
        inj.kill_coordinator(at_step=kill_at)
    return inj


def _wait_until_persisted(tiers: tuple[str, ...], timeout_s: float = 45.0) -> None:
    """Hold the drill's kill until every tier has committed a checkpoint of a trained step.

    Uploads run in the background, so at the kill step the newest one may still be in
    flight; killing then would resume from step 0 (persisted at the start) and show
    nothing. The deadline stays under the 60 s the faulting rank waits for the driver.
    """
    import time

    from memckpt.persist.catalog import CheckpointStore
    stores = [CheckpointStore(t) for t in tiers]
    deadline = time.monotonic() + timeout_s
    while True:
        pending = [s.uri for s in stores
                   if not any(c.complete and (c.step or 0) > 0 for c in s.list_checkpoints())]
        if not pending:
            return
        if time.monotonic() > deadline:
            print(f"no persisted checkpoint in {', '.join(pending)} after {timeout_s:.0f} s; "
                  "killing the cluster anyway (the new job starts from step 1)", flush=True)
            return
        time.sleep(0.2)


def persisted_tiers(run_root: Path, s3: Optional[str]) -> tuple[str, ...]:
    """The tiers the whole-cluster drill persists to: a folder, and S3 when given."""
    return (str(run_root / "persisted"),) + ((s3,) if s3 else ())


def _lose_the_cluster(job, kill_at: int, run_root: Path, s3: Optional[str]) -> None:
    """Persist to a folder (and S3) and lose every node mid-run; the caller resumes the job
    on a new cluster."""
    import memckpt
    from memckpt.runtime.chaos.faults import FaultInjector
    from memckpt.runtime.tools.local_cluster import local_cluster

    tiers = persisted_tiers(run_root, s3)
    pulled = []
    with local_cluster(nodes=3) as cluster:
        def pull_the_plug(_node: str) -> None:
            _wait_until_persisted(tiers)
            pulled.append(True)
            for n in list(cluster.nodes):
                cluster.remove_node(n)

        inj = FaultInjector(node_killer=pull_the_plug)
        inj.kill_node(rank=0, at_step=kill_at)
        try:
            with drill_notices("cluster"):
                memckpt.run(job, demo_config("demo", persist=tiers), run_dir=run_root / "lost",
                            injector=inj)
        except memckpt.MemckptError as e:
            if not pulled:  # not the drill: a real failure must not pass for a resumed run
                raise
            print(f"whole cluster lost at step {kill_at}: {e}", flush=True)
    print("starting a new cluster; the job resumes from the persisted tier", flush=True)


PARALLELISM = {"ddp": "DDP + ZeRO", "fsdp": "FSDP2 (every block fully_shard-ed)"}
WHAT_DIES = {
    "worker": "rank 1's worker process is SIGKILLed",
    "node": "rank 1's node is removed (its raylet, workers and replica store killed)",
    "store": "the replica store on rank 1's node is SIGKILLed",
    "coordinator": "the coordinator is SIGKILLed",
    "cluster": "every node is lost (a persisted tier keeps the state), then a new cluster "
               "resumes",
}
# Measured on a 2-core machine, tiny model: starting the 3-node cluster, a generation of
# workers (torch imported, process group), a recovery; a step of 3 ranks per model size.
START_S, GENERATION_S, RECOVERY_S = 25.0, 20.0, 12.0
STEP_S = {"tiny": 0.3, "mini": 3.5, "small": 10.0}


def estimate_s(fault: str, steps: int, size: str, compare: bool, elastic: bool) -> float:
    """About how long the demo takes on a 2-core machine (the first line says it)."""
    runs = 2 if compare and fault != "none" and not elastic else 1
    total = START_S + runs * (GENERATION_S + steps * STEP_S.get(size, 1.0))
    if fault != "none":
        total += RECOVERY_S
    if fault == "cluster":
        total += START_S + GENERATION_S
    if elastic:
        total += START_S / 2 + RECOVERY_S + steps * ELASTIC_STEP_DELAY_S  # grown back
    return total


def plan_line(fault: str, steps: int, kill_at: int, size: str, model: str, compare: bool,
              elastic: bool) -> str:
    """The demo's first line: what will happen, and about how long it takes."""
    from memckpt.demo.model import PRESETS, count_parameters
    minutes = max(0.5, round(estimate_s(fault, steps, size, compare, elastic) / 30) / 2)
    params = count_parameters(PRESETS[size]) / 1e6
    line = (f"memckpt demo (about {minutes:g} min on 2 cores): a 3-node local Ray cluster "
            f"trains GPT '{size}' ({params:.2f}M params, {PARALLELISM[model]} over gloo) for "
            f"{steps} steps, snapshotting to RAM every step with 1 replica on the next node")
    if elastic:
        return line + (f"; after step {kill_at} rank 1's node is removed with no room to "
                       "spare: the job goes on with 2 ranks from RAM, then grows back to 3 "
                       "when a node is added")
    if fault == "none":
        return line + "; no fault (the uninterrupted reference run)"
    ready = (", once every node's warm spare is up (as in a job past its first minute)"
             if fault in ("worker", "node") else "")
    line += f"; after step {kill_at}{ready} {WHAT_DIES[fault]} and the job recovers"
    return line + ("; then an uninterrupted run of the same job shows the result is "
                   "bit-identical" if compare else "")


def run_ray_demo(fault: str = "worker", steps: int = 20, kill_at: Optional[int] = None,
                 size: str = "tiny", summary: Optional[str] = None, compare: bool = True,
                 seed: int = 0, s3: Optional[str] = None, model: str = "ddp",
                 elastic: bool = False) -> int:
    import memckpt
    from memckpt.demo.job import FSDPJob, GPTJob
    from memckpt.runtime.tools.local_cluster import local_cluster

    # The job's DDP uses find_unused_parameters=True for exact resume; silence torch's
    # C++ note about it in the workers (they inherit this environment through the raylets).
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    kill_at = kill_at or max(1, steps // (4 if elastic else 2))
    job = (FSDPJob if model == "fsdp" else GPTJob)(steps=steps, size=size, seed=seed)
    run_root = Path(tempfile.mkdtemp(prefix="memckpt-demo-"))
    print(plan_line(fault, steps, kill_at, size, model, compare, elastic), flush=True)
    try:
        if elastic:
            result = _elastic_demo(steps, kill_at, size, seed)
            for line in recovery_lines(result):
                print(line, flush=True)
            if summary:
                Path(summary).write_text(json.dumps(result, indent=1, default=str))
            sizes = [r.get("resized", {}).get("to") for r in result["recoveries"]]
            return 0 if sizes[-2:] == [2, 3] else 1
        if fault == "cluster":
            _lose_the_cluster(job, kill_at, run_root, s3)
        # the reference run takes the faulted (or resumed) run's worker processes
        with local_cluster(nodes=3) as cluster, memckpt.keep_workers():
            if fault == "cluster":
                result = memckpt.run(job, demo_config("demo", persist=persisted_tiers(
                    run_root, s3)), run_dir=run_root / "resumed")
            else:
                with drill_notices(fault):
                    result = memckpt.run(job, demo_config("demo"), run_dir=run_root / "faulted",
                                         injector=injector_for(fault, kill_at, cluster))
            result["step_s"] = step_time_s(run_root / ("resumed" if fault == "cluster"
                                                       else "faulted"))
            if compare and fault != "none":
                while len(cluster.nodes) < 3:  # the reference needs the full cluster back
                    cluster.add_node()
                print("now the same job uninterrupted, to compare (quietly)", flush=True)
                ref = memckpt.run(job, demo_config("demo-reference"),
                                  run_dir=run_root / "reference", quiet=True)
                # a run resumed from the persisted tier reports the steps it trained
                first = result.get("first_step") or 1
                same_losses = ref["losses"][first - 1:] == result["losses"]
                same_digest = ref["final_digest"] == result["final_digest"]
                result["reference_losses"] = ref["losses"]
                result["reference_digest"] = ref["final_digest"]
                result["identical"] = same_losses and same_digest
                print(f"against an uninterrupted run: losses identical: "
                      f"{'yes' if same_losses else 'NO'}; final digest identical: "
                      f"{'yes' if same_digest else 'NO'}", flush=True)
            for line in recovery_lines(result):
                print(line, flush=True)
        if summary:
            Path(summary).parent.mkdir(parents=True, exist_ok=True)  # as the local demo does
            Path(summary).write_text(json.dumps(result, indent=1, default=str))
        return 0 if result.get("identical", True) else 1
    finally:
        shutil.rmtree(run_root, ignore_errors=True)
