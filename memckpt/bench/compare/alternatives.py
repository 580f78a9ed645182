"""The methods ``memckpt bench compare`` puts side by side, and the step loop they all run in.

Every method runs the same loop (:func:`step_loop`): a fixed simulated forward+backward
(``compute_n`` 256x256 matmuls, calibrated once by the driver, the same for every method),
then the method's checkpoint call. Per step it records

  step_s      compute + checkpoint call (so CPU stolen by background work shows up)
  blocking_s  the checkpoint call alone (what the training thread waits for)
  compute_s   the compute alone (it stretches when background work competes for the cores)

Methods (one process each, or one Ray job each):

  none              no checkpoint
  memcpy            copy every tensor into a preallocated buffer (the physical limit)
  memckpt-local     memckpt.Checkpointer, sync mode: the local RAM copy only
  memckpt           memckpt.run on a local 2-node Ray cluster: snapshot + replication to the
                    peer node's store every step (the runtime's own harness; its "none" is the
                    same job with snapshots off)
  torch.save        torch.save of model + optimizer state_dict to local disk, flush + fsync
  dcp-async         torch.distributed.checkpoint.async_save (gloo, world size 1, default
                    thread executor); blocking part = get_state_dict + the async_save call
                    (staging copy) + waiting for the previous save to finish
  ray-train         ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d)) from a
                    TorchTrainer worker; blocking part = torch.save into d + report(), which
                    in Ray 2.60 copies d to RunConfig(storage_path) synchronously (the default
                    CheckpointUploadMode.SYNC); its "none" is report(metrics) alone

Recovery alternatives (a 2-rank job, rank 1 SIGKILLs itself, time to the first resumed step):
:class:`DCPWorker` (dcp.save / dcp.load in the restart-every-worker flow of
:mod:`memckpt.bench.recovery`) and :func:`raytrain_recovery` (Ray Train's own restart from
its storage path with ``FailureConfig(max_failures=1)``).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gc
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterator, Optional

from memckpt.bench.common import end_rank_process, evict_from_page_cache
from memckpt.bench.recovery import workload as rjob
from memckpt.bench.foreign_load import Quiet
from memckpt.bench.recovery.bench_actors import ColdWorker
from memckpt.bench.recovery.measure import WORLD_SIZE
from memckpt.bench.snapshot.measure import build_state, matmul_unit, measure_memcpy
from memckpt.util.netutil import free_port

PLAIN_METHODS = ("none", "memcpy", "memckpt-local", "torch.save", "dcp-async")
RAY_METHODS = ("memckpt-none", "memckpt", "ray-train-none", "ray-train")
TORCH_THREADS = 2


# -- the loop -----------------------------------------------------------------------------------
def step_loop(compute: Callable[[], None], save: Callable[[int], Any], steps: int, warmup: int,
              between: Optional[Callable[[int], None]] = None) -> dict[str, Any]:
    """``warmup`` + ``steps`` iterations of compute() then save(step); the warm-up is dropped.
    ``between(step)`` runs untimed after each step (cleanup of old files). Returns the seconds
    per step (step_s, blocking_s, compute_s); callers add their own figures to the dict."""
    out: dict[str, list[float]] = {"step_s": [], "blocking_s": [], "compute_s": []}
    for i in range(1, warmup + steps + 1):
        t0 = time.perf_counter()
        compute()
        t1 = time.perf_counter()
        save(i)
        t2 = time.perf_counter()
        if i > warmup:
            out["step_s"].append(t2 - t0)
            out["blocking_s"].append(t2 - t1)
            out["compute_s"].append(t1 - t0)
        if between is not None:
            between(i)
    return out


def make_compute(n: int) -> Callable[[], None]:
    run = matmul_unit()
    return lambda: run(n)


def _set_threads() -> None:
    import torch
    torch.set_num_threads(TORCH_THREADS)


def _single_rank_group() -> None:
    """A gloo process group of world size 1 (DCP's collectives need one)."""
    import datetime

    import torch.distributed as dist
    if not dist.is_initialized():
        port = free_port("127.0.0.1")
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1, timeout=datetime.timedelta(seconds=120))


def torch_save_fsync(obj: Any, path: Path) -> int:
    import torch
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def _rmtree_later(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


# -- plain-process methods ----------------------------------------------------------------------
class _DCPAsync:
    """dcp.async_save every step, at most one save in flight (the documented pattern)."""

    def __init__(self, model, opt, directory: Path) -> None:
        _single_rank_group()
        self.model, self.opt, self.dir = model, opt, directory
        self.future: Optional[cf.Future[Any]] = None
        self.started: dict[int, float] = {}
        self.persist_s: list[float] = []  # async_save call -> its future done

    def save(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        self.wait()
        msd, osd = get_state_dict(self.model, self.opt)
        t0 = time.perf_counter()
        ret = dcp.async_save({"model": msd, "optim": osd},
                             checkpoint_id=str(self.dir / f"step-{step}"))
        # the save's Future, or an AsyncSaveResponse (a custom stager) holding it
        fut = ret if isinstance(ret, cf.Future) else ret.upload_completion

        def done(_f: cf.Future[Any]) -> None:
            self.persist_s.append(time.perf_counter() - t0)
        fut.add_done_callback(done)
        self.future = fut

    def wait(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def cleanup(self, step: int) -> None:  # keep the newest two checkpoints
        _rmtree_later(self.dir / f"step-{step - 2}")


def run_plain(size: int, steps: int, warmup: int, compute_n: int, directory: Path,
              ram_root: Optional[str], methods: tuple[str, ...] = PLAIN_METHODS,
              log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every plain method at one state size, in this process, one after the other."""
    import torch

    from memckpt.checkpointer import Checkpointer
    from memckpt.config import Config
    from memckpt.format.state import TrainState

    _set_threads()
    model, opt = build_state(size)
    state = TrainState(model=model, optimizer=opt)
    cap = state.capture(0)
    state_bytes, tensors = cap.nbytes, list(cap.tensors)
    del cap
    compute = make_compute(compute_n)
    compute()  # the first matmuls start torch's thread pool: not any method's cost
    out: dict[str, Any] = {"state_bytes": state_bytes, "methods": {}}

    def record(method: str, res: dict[str, Any]) -> None:
        out["methods"][method] = res
        log(f"{method}: step {1e3 * median(res['step_s']):.1f} ms, blocking "
            f"{1e3 * median(res['blocking_s']):.1f} ms")
        gc.collect()

    for method in methods:
        gc.collect()
        if method == "none":
            record(method, step_loop(compute, lambda s: None, steps, warmup))
        elif method == "memcpy":
            times = measure_memcpy(tensors, steps, Quiet())["times"]
            record(method, {"step_s": times, "blocking_s": times, "compute_s": [0.0] * len(times),
                            "note": "copy alone, no compute (the limit)"})
        elif method == "memckpt-local":
            ckpt = Checkpointer(Config(job_name=f"bench-compare-{os.getpid()}", ram_root=ram_root))
            try:
                res = step_loop(compute, lambda s: ckpt.step(state, s), steps, warmup)
                ckpt.wait()
            finally:
                ckpt.close(unlink=True)
            record(method, res)
        elif method == "torch.save":
            path = directory / f"compare-{os.getpid()}.pt"
            sizes: list[int] = []

            def save(_s: int) -> None:
                sizes.append(torch_save_fsync({"model": model.state_dict(),
                                               "optimizer": opt.state_dict()}, path))
            try:
                res = step_loop(compute, save, steps, warmup)
            finally:
                path.unlink(missing_ok=True)
            res["bytes_written"] = sizes[-1]
            record(method, res)
        elif method == "dcp-async":
            d = Path(tempfile.mkdtemp(prefix="compare-dcp-", dir=directory))
            dcp = _DCPAsync(model, opt, d)
            try:
                res = step_loop(compute, dcp.save, steps, warmup, between=dcp.cleanup)
                dcp.wait()
            finally:
                shutil.rmtree(d, ignore_errors=True)
            res["persist_s"] = dcp.persist_s[warmup:]
            record(method, res)
        elif method == "raw-disk-write":
            from memckpt.bench.persist.measure import write_fsync
            buf = torch.empty(state_bytes, dtype=torch.uint8).fill_(1).numpy()
            path = directory / f"compare-raw-{os.getpid()}.bin"
            times = []
            try:
                for _ in range(max(1, min(steps, 3))):
                    t0 = time.perf_counter()
                    write_fsync(path, buf)
                    times.append(time.perf_counter() - t0)
                    path.unlink()
            finally:
                path.unlink(missing_ok=True)
            del buf
            record(method, {"step_s": times, "blocking_s": times, "compute_s": [0.0] * len(times),
                            "note": "one file write + fsync of the state's bytes (the disk limit)"})
        else:
            raise ValueError(f"unknown method {method!r}")
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    return out


# -- Ray-based methods --------------------------------------------------------------------------
@dataclass(frozen=True)
class StallJob:
    """memckpt.run's training function for the stall: the same loop, ``ctx.step`` as the save.
    Rank 0 also reads every store's held bytes (memory per node) at the end."""

    size: int
    steps: int
    warmup: int
    compute_n: int
    full_ranks: int = 1  # ranks >= this are peers with a 64 KiB state and no compute
    threads: int = TORCH_THREADS

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch

        import memckpt
        torch.set_num_threads(self.threads)
        full = ctx.rank < self.full_ranks
        model, opt = build_state(self.size if full else 64 << 10, seed=ctx.rank)
        state = memckpt.TrainState(model=model, optimizer=opt)
        ctx.restore(state)
        compute = make_compute(self.compute_n) if full else (lambda: None)
        compute()
        res = step_loop(compute, lambda s: ctx.step(state, s), self.steps, self.warmup)
        res["rank"] = ctx.rank
        res["state_bytes"] = state.capture(0).nbytes
        res["replicate_s"] = float(ctx.stats()["replicate_s"])
        if ctx.rank == 0:
            from memckpt.runtime.driver.actors import held_bytes
            res["store_bytes"] = held_bytes(ctx.config.job_name)  # node id -> bytes held
        return res


def memckpt_stall(job: StallJob, *, snapshots: bool, workers: int, replicas: int,
                  ram_root: str, run_dir: Path, name: str,
                  cpus_per_worker: float) -> dict[str, Any]:
    """One memckpt.run of ``job`` on ``workers`` ranks (one per node); the step figures are
    rank 0's (a full rank), every rank's in ``per_rank``."""
    import memckpt
    total = job.warmup + job.steps
    cfg = memckpt.Config(
        job_name=name,
        workers=memckpt.WorkersConfig(num_workers=workers, workers_per_node=1,
                                      cpus_per_worker=cpus_per_worker),
        placement=memckpt.PlacementConfig("ring", replicas),
        snapshot_every=1 if snapshots else total + 1, ram_root=ram_root,
        failure=memckpt.FailureConfig(max_restarts=0, warm_spares=False))
    try:
        summary = memckpt.run(job, cfg, run_dir=run_dir / name, quiet=True)
    finally:
        shutil.rmtree(Path(ram_root) / name, ignore_errors=True)
    results = sorted(summary["results"], key=lambda r: r["rank"])
    r0 = dict(results[0])
    r0["per_rank"] = [{k: r[k] for k in ("rank", "step_s", "blocking_s", "replicate_s")}
                      for r in results]
    r0["ranks"] = len(results)
    return r0


def _raytrain_stall_loop(config: dict[str, Any]) -> None:
    """TorchTrainer worker: the step loop with ray.train.report as the save."""
    import ray.train as train
    _set_threads()
    model, opt = build_state(config["size"])
    work = Path(tempfile.mkdtemp(prefix="compare-raytrain-", dir=config["local_dir"]))
    parts: dict[str, list[float]] = {"write_s": [], "report_s": []}

    def save(step: int) -> None:
        if not config["checkpoint"]:
            train.report({"step": step})
            return
        d = work / f"step-{step}"
        d.mkdir()
        t0 = time.perf_counter()
        torch_save_fsync({"model": model.state_dict(), "optimizer": opt.state_dict()}, d / "state.pt")
        t1 = time.perf_counter()
        train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(str(d)))
        t2 = time.perf_counter()
        parts["write_s"].append(t1 - t0)
        parts["report_s"].append(t2 - t1)

    def between(step: int) -> None:  # the local copy is ours to delete (SYNC mode keeps it)
        shutil.rmtree(work / f"step-{step}", ignore_errors=True)

    try:
        res = step_loop(make_compute(config["compute_n"]), save, config["steps"], config["warmup"],
                        between=between)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    w = config["warmup"]
    res.update({k: v[w:] for k, v in parts.items()})
    from memckpt.format.state import TrainState
    res["state_bytes"] = TrainState(model=model, optimizer=opt).capture(0).nbytes
    Path(config["out"]).write_text(json.dumps(res))


@contextmanager
def raytrain_poll(seconds: Optional[float]) -> Iterator[None]:
    """Ray Train 2.60's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
    (default 2 s) and each worker's result queue holds one report, so report() blocks until
    the previous one was polled. None keeps Ray's default; the driver's value reaches the
    controller and the workers (Ray Train propagates it)."""
    key = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
    old = os.environ.get(key)
    if seconds is not None:
        os.environ[key] = repr(float(seconds))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


def raytrain_stall(size: int, steps: int, warmup: int, compute_n: int, *, checkpoint: bool,
                   storage: Path, local_dir: Path, name: str) -> dict[str, Any]:
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out = local_dir / f"{name}.json"
    trainer = TorchTrainer(
        _raytrain_stall_loop,
        train_loop_config={"size": size, "steps": steps, "warmup": warmup, "compute_n": compute_n,
                           "checkpoint": checkpoint, "local_dir": str(local_dir), "out": str(out)},
        scaling_config=ScalingConfig(num_workers=1, resources_per_worker={"CPU": TORCH_THREADS}),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    try:
        trainer.fit()
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)
        shutil.rmtree(storage / name, ignore_errors=True)


# -- recovery alternatives ----------------------------------------------------------------------
class DCPWorker(ColdWorker):
    """:class:`memckpt.bench.recovery.bench_actors.ColdWorker` with DCP instead of torch.save /
    torch.load: ``dcp.save`` of get_state_dict(model, optimizer) into a per-rank checkpoint
    directory, and on restart ``dcp.load`` + ``set_state_dict`` (no collectives: each rank
    owns its state)."""

    def save_checkpoint(self, path: str, d: int, n: int, seed: int) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model, opt = rjob.build_state(d, n, fresh=True, seed=seed)
        self.model, self.opt = model, opt
        msd, osd = get_state_dict(model, opt)
        shutil.rmtree(path, ignore_errors=True)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path, no_dist=True)
        return evict_from_page_cache(Path(path))

    def restore_and_step(self, path: str, master: tuple[str, int], rank: int, world: int,
                         d: int, n: int, compute_iters: int) -> dict[str, Any]:
        """ColdWorker's own restart (process group, build, load, first step), with its
        ``torch.load(path)`` answered by DCP for the duration of the call."""
        import torch
        real = torch.load

        def dcp_load(f: Any, *args: Any, **kwargs: Any) -> Any:  # torch.load's parameter names
            return self._dcp_load(f, d, n) if str(f) == path else real(f, *args, **kwargs)

        torch.load = dcp_load
        try:
            return super().restore_and_step(path, master, rank, world, d, n, compute_iters)
        finally:
            torch.load = real
            shutil.rmtree(path, ignore_errors=True)

    @staticmethod
    def _dcp_load(path: str, d: int, n: int) -> dict[str, Any]:
        """dcp.load in place into a model + optimizer whose state exists (DCP loads into
        allocated tensors, as a real job's restore does), returned as plain state dicts."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model, opt = rjob.build_state(d, n, fresh=True)
        msd, osd = get_state_dict(model, opt)
        sd: dict[str, Any] = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=path, no_dist=True)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def dcp_recovery(bench: Any, rep: int) -> dict[str, Any]:
    """:meth:`RecoveryBench.restart_baseline <memckpt.bench.recovery.measure.RecoveryBench.
    restart_baseline>` with DCPWorker actors (the flow, kill and timing stay its own)."""
    return bench.restart_baseline(rep, worker=DCPWorker)


def _raytrain_recovery_loop(config: dict[str, Any]) -> None:
    """TorchTrainer worker (2 ranks): report a torch.save checkpoint every step; rank 1
    SIGKILLs itself at ``kill_at``; after Ray Train's restart, load and time one step."""
    import torch
    import torch.distributed as dist

    import ray.train as train
    ctx = train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    torch.set_num_threads(config["cpus"])
    ckpt = train.get_checkpoint()
    d, n = config["d"], config["n"]
    x, w = rjob.compute_inputs()
    if ckpt is not None:  # the resumed generation
        t0 = time.time()
        model, opt = rjob.build_state(d, n, fresh=False)
        t1 = time.time()
        with ckpt.as_directory() as cdir:
            sd = torch.load(Path(cdir) / f"rank{rank}.pt", weights_only=True)
            step = int(json.loads((Path(cdir) / "step.json").read_text())["step"])
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        del sd
        t2 = time.time()
        float(rjob.all_reduce_mean(rjob.compute_loss(x, w, config["compute_iters"]), world))
        t3 = time.time()
        Path(config["out_dir"], f"resumed-{rank}.json").write_text(json.dumps(
            {"t_enter": t0, "build": t1 - t0, "load": t2 - t1, "first_step": t3 - t2,
             "t_done": t3, "resumed_step": step}))
        return
    model, opt = rjob.build_state(d, n, fresh=True, seed=rank)
    local = Path(tempfile.mkdtemp(prefix="compare-raytrain-rec-", dir=config["local_dir"]))
    for step in range(1, config["kill_at"] + 1):
        float(rjob.all_reduce_mean(rjob.compute_loss(x, w, config["compute_iters"]), world))
        if step == config["kill_at"] and rank == 1:
            Path(config["marker"]).write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        if step == config["kill_at"]:
            time.sleep(600)  # rank 0 waits for the failure (as a collective would)
        cdir = local / f"step-{step}"
        cdir.mkdir()
        torch_save_fsync({"model": model.state_dict(), "optimizer": opt.state_dict()},
                         cdir / f"rank{rank}.pt")
        (cdir / "step.json").write_text(json.dumps({"step": step}))
        train.report({"step": step}, checkpoint=train.Checkpoint.from_directory(str(cdir)))
        shutil.rmtree(cdir, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()


def _drop_cache(root: Path) -> None:
    for f in root.rglob("*.pt"):
        try:
            with open(f, "rb") as fh:
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass


def raytrain_recovery(d: int, n: int, kill_at: int, compute_iters: int, storage: Path,
                      local_dir: Path, name: str, cpus: int) -> dict[str, Any]:
    """Kill rank 1 of a 2-rank TorchTrainer; Ray Train restarts the worker group from the newest
    checkpoint in storage_path. Total = fault -> every rank finished its first resumed step."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer
    out_dir = Path(tempfile.mkdtemp(prefix="compare-raytrain-out-", dir=local_dir))
    marker = out_dir / "fault"
    trainer = TorchTrainer(
        _raytrain_recovery_loop,
        train_loop_config={"d": d, "n": n, "kill_at": kill_at, "compute_iters": compute_iters,
                           "cpus": cpus, "local_dir": str(local_dir), "out_dir": str(out_dir),
                           "marker": str(marker)},
        scaling_config=ScalingConfig(num_workers=WORLD_SIZE, resources_per_worker={"CPU": cpus}),
        run_config=RunConfig(name=name, storage_path=str(storage),
                             failure_config=FailureConfig(max_failures=1),
                             checkpoint_config=CheckpointConfig(num_to_keep=2)))
    try:
        trainer.fit()
        t_fault = float(marker.read_text())
        outs = [json.loads(p.read_text()) for p in sorted(out_dir.glob("resumed-*.json"))]
        if len(outs) != WORLD_SIZE:
            raise RuntimeError(f"Ray Train resumed {len(outs)} of {WORLD_SIZE} ranks")
        slow = max(outs, key=lambda o: o["t_done"])
        phases = {"restart": slow["t_enter"] - t_fault, "build": slow["build"],
                  "torch_load": slow["load"], "first_step": slow["first_step"],
                  "total": slow["t_done"] - t_fault}
        return {"total_s": phases["total"], "phases_s": phases,
                "resumed_step": slow["resumed_step"]}
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
        shutil.rmtree(storage / name, ignore_errors=True)


# -- subprocess entry: the plain methods at one size --------------------------------------------
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m memckpt.bench.compare.alternatives")
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--warmup", type=int, required=True)
    p.add_argument("--compute-n", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--ram-root", default=None)
    p.add_argument("--methods", default=",".join(PLAIN_METHODS))
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    res = run_plain(a.size, a.steps, a.warmup, a.compute_n, Path(a.dir), a.ram_root,
                    tuple(a.methods.split(",")),
                    log=lambda m: print(f"[bench compare {a.size >> 20}M] {m}", file=sys.stderr,
                                        flush=True))
    Path(a.out).write_text(json.dumps(res))
    end_rank_process()  # its gloo group's teardown at exit could abort a finished run


if __name__ == "__main__":
    sys.exit(main())
