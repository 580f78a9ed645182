"""Recovery time: memckpt against restarting every worker from a torch.save file.

Everything runs in one process on one local multi-node Ray cluster
(:class:`memckpt.runtime.tools.local_cluster.LocalCluster`: 3 worker nodes of 2 CPUs, a 0-CPU
head), so both sides see the same machine:

  memckpt-worker     a synthetic 2-rank job (one rank per node, ring placement,
                     1 replica) whose rank 1 SIGKILLs itself at a fixed step; the
                     runtime restores it from its node's RAM
  memckpt-node       the same job; at that step rank 1's whole node is removed
                     (raylet, worker, store); rank 1 restarts on the spare node and
                     pulls its shard from the peer that holds its replica
  restart+torch.load the usual alternative: the same state saved beforehand with
                     torch.save to local disk (page cache dropped), the same
                     self-SIGKILL, then every worker killed, new Ray actors (cold
                     processes that import torch), torch.load + load_state_dict,
                     one step
  restart+torch.load-node-lost
                     the same alternative after the node rows' failure: rank 1's
                     node removed, its death seen once Ray declares the node dead,
                     rank 1 restarted on the third node (its file read from this
                     machine's disk: on a real cluster it would have died with the
                     node). The node rows' ratio is against this one
  peer fetch         vs a raw TCP transfer of the same bytes between the same two
                     nodes (sendall -> recv_into): the path it takes
  replication        vs raw TCP transfers of the same bytes between the same two
                     nodes, both ways at once (sendall -> recv_into): the path it takes
  transfer paths     the same two paths with nothing else running (a shard streamed
                     into a peer's store both ways at once and verified there; one
                     fetched back), against raw TCP measured in the same call. In the
                     job, the 2 cores of this machine also run the training, the other
                     rank's restore and every simulated node's processes
  step time          memckpt.demo.job.GPTJob with a snapshot + replication every
                     step, with local snapshots only (no replica), and with
                     snapshots off

The memckpt faults are steady: they fire once the job is in standby (every node's warm
spare up, its restore memory prepared), as in a job that has run for a while.
Recovery is timed from the fault (the instant the victim claimed it) to the
moment every rank has finished its first step after the restore, and split into
the phases the runtime records (detect, stop, plan, resume, fetch_and_load_max)
plus, for the slowest rank, where its resume went (start, build, fetch, verify,
load, re-snapshot, first step). Each figure is the median over ``--repeats``.

The machine may be shared: every measurement records the CPU share other
processes took meanwhile (``foreign_cpu``; the report warns above 10%), and
``--wait-quiet SECONDS`` waits for a quieter machine before each one. The
nodes are simulated on one machine, so a removed node's shared-memory files
are deleted with it (its RAM would be gone on a real cluster).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

# The measurements are in recovery_measure (the synthetic job they run in recovery_job, the
# Ray actors of the alternative and of the raw transfers in recovery_actors), the rows in
# recovery_rows, the report in recovery_report.
from memckpt.bench.common import (GIB, disk_dir, positive_int, ram_dir, standalone,
                                  usable_dir, write_rows)
from memckpt.bench.common import machine_info as _base_machine_info
from memckpt.bench.foreign_load import QUIET_THRESHOLD
from memckpt.bench.recovery.bench_actors import ColdWorker
from memckpt.bench.recovery.workload import (DEFAULT_COMPUTE_ITERS, DEFAULT_KILL_AT, DEFAULT_LAYERS,
                                        DEFAULT_STATE_MB, DEFAULT_STEPS_AFTER)
from memckpt.bench.recovery.measure import (CPUS_PER_NODE, GPT_WARMUP_STEPS, NODES,
                                            RecoveryBench, connect_driver)
from memckpt.bench.recovery.report import report
from memckpt.bench.recovery.rows import Samples, build_rows
from memckpt.runtime.driver.kept import keep_workers
from memckpt.util.fsutil import fs_type

DEFAULT_REPEATS = 3
DEFAULT_GPT_STEPS = 30


def machine_info() -> dict[str, Any]:
    return {**_base_machine_info(),
            "cluster": f"memckpt.runtime.tools.local_cluster.LocalCluster: {NODES} simulated nodes x "
                       f"{CPUS_PER_NODE} CPUs on one machine + a 0-CPU head"}


def memory_needed(state_bytes: int) -> int:
    """About 5x the state on each of the two training nodes (live state, 2 own snapshot slots,
    2 replica slots), a dead node's files until they are freed, object-store copies of a
    peer fetch, and ~4 GiB for the Ray and worker processes."""
    return 14 * state_bytes + 4 * GIB


def run_recovery_bench(state_mb: float = DEFAULT_STATE_MB, repeats: int = DEFAULT_REPEATS, *,
                       directory: Optional[str] = None, layers: int = DEFAULT_LAYERS,
                       kill_at: int = DEFAULT_KILL_AT, steps_after: int = DEFAULT_STEPS_AFTER,
                       compute_iters: int = DEFAULT_COMPUTE_ITERS, gpt_size: str = "mini",
                       gpt_steps: int = DEFAULT_GPT_STEPS, wait_quiet_s: float = 0.0,
                       cluster: Any = None,
                       log: Optional[Callable[[str], None]] = None) -> list[dict[str, Any]]:
    """Measure everything in one run on one local cluster; returns the result rows.

    ``cluster``: an existing :class:`~memckpt.runtime.tools.local_cluster.LocalCluster` with 3 worker nodes
    (left running), else one is started and shut down here. ``wait_quiet_s``: before each
    measurement wait up to that long for other processes to leave the CPU (shared machines).
    Every sample records ``foreign_cpu``, the CPU share other processes took during it.
    """
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if kill_at < 2:
        raise ValueError("kill_at must be >= 2 so a step is committed before the fault")
    if gpt_steps < GPT_WARMUP_STEPS + 3:
        raise ValueError(f"gpt_steps must be >= {GPT_WARMUP_STEPS + 3}")
    log = log or (lambda msg: print(f"[bench recovery] {msg}", file=sys.stderr, flush=True))
    target = int(state_mb * (1 << 20))
    # The job's DDP (step-time part) warns about find_unused_parameters; the workers inherit
    # this through the raylets.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    disk = disk_dir(directory, "memckpt-bench-recovery-")
    ram_root = ram_dir("memckpt-bench-recovery-")
    run_root = Path(tempfile.mkdtemp(prefix="memckpt-bench-recovery-runs-"))
    own = cluster is None
    try:
        if own:
            from memckpt.runtime.tools.local_cluster import LocalCluster
            # The object store must hold one whole shard (a peer restore moves it as one object).
            store_mb = max(256, int(1.25 * target / 2**20) + 128)
            log(f"starting a local cluster: {NODES} nodes x {CPUS_PER_NODE} CPUs, "
                f"object store {store_mb} MiB per node")
            cluster = LocalCluster(nodes=NODES, cpus_per_node=CPUS_PER_NODE, object_store_mb=store_mb)
            connect_driver(cluster)
        b = RecoveryBench(cluster, target, layers, kill_at, steps_after, compute_iters, disk, ram_root,
                   run_root, log)
        b.wait_quiet_s = wait_quiet_s
        b.restore_nodes()
        log(f"state per rank: {b.n} x Linear({b.d}) + AdamW = {b.state_bytes / 2**20:.1f} MiB; "
            f"fault at step {kill_at}; torch.save files in {disk} ({fs_type(disk)})")
        got = Samples()
        for rep in range(repeats):
            log(f"repeat {rep + 1}/{repeats}")
            s = b.measure(b.memckpt_recovery, "worker", rep)
            got.worker.append(s)
            nodes = sorted({r["node_id"] for r in s["results"]})
            if len(nodes) == 2 and s["replication"]:
                shard = max(x[0] for x in s["replication"])
                got.raw2.append(b.measure(b.raw_transfer_2way, nodes[0], nodes[1], shard))
                got.paths.append(b.measure(b.transfer_paths, nodes[0], nodes[1], shard))
            try:
                s = b.measure(b.memckpt_recovery, "node", rep)
                got.node.append(s)
                if "peer_fetch" in s:
                    pf = s["peer_fetch"]
                    got.raw.append(b.measure(b.raw_transfer, pf["src"], pf["dst"], pf["bytes"]))
            finally:
                b.restore_nodes()
            try:
                got.standby.append(b.measure(b.memckpt_recovery, "node-standby", rep))
            finally:
                b.restore_nodes()
            got.base.append(b.measure(b.restart_baseline, rep))
            try:  # the same node loss for the alternative
                got.base_node.append(b.measure(b.restart_baseline, rep, ColdWorker, True))
            finally:
                b.restore_nodes()
        # one job after another on the same nodes and shape: each takes the worker processes
        # the one before it left (memckpt.keep_workers), as a sweep would; steps are timed
        # once training runs, so where a process came from does not enter them
        with keep_workers():
            for rep in range(repeats):
                for mode, runs in (("on", got.on), ("persist", got.persist),
                                   ("local", got.local), ("off", got.off)):
                    runs.append(b.measure(b.step_time, mode, rep, gpt_size, gpt_steps))
        rows = [r.to_dict() for r in build_rows(b, got, gpt_size)]
        info = machine_info()
        for r in rows:
            r["machine"] = info
            r["repeats"] = repeats
            r["retried_measurements"] = b.retries
        return rows
    finally:
        if own and cluster is not None:
            cluster.shutdown()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(ram_root, ignore_errors=True)
        shutil.rmtree(run_root, ignore_errors=True)



# -- command line -------------------------------------------------------------------------------
def _state_mb(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not (math.isfinite(v) and v >= 1):
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: give MiB per rank, >= 1")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-mb", type=_state_mb, default=DEFAULT_STATE_MB, metavar="MB",
                        help=f"training state per rank in MiB: params + AdamW moments "
                             f"(default {DEFAULT_STATE_MB})")
    parser.add_argument("--repeats", type=positive_int, default=DEFAULT_REPEATS, metavar="N",
                        help=f"repeats of every measurement; medians are reported "
                             f"(default {DEFAULT_REPEATS})")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as a JSON list to PATH")
    parser.add_argument("--dir", metavar="DIR", default=None,
                        help="local-disk directory for the torch.save files (default: a temp dir "
                             "on disk, never a tmpfs)")
    parser.add_argument("--gpt-steps", type=positive_int, default=DEFAULT_GPT_STEPS, metavar="N",
                        help=f"steps of each step-time run (default {DEFAULT_GPT_STEPS}; the first "
                             f"{GPT_WARMUP_STEPS} are left out)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="on a shared machine: before each measurement wait up to SECONDS for "
                             f"other processes to use < {QUIET_THRESHOLD * 100:.0f}%% of the CPU "
                             "(default 0: off; the CPU other processes took is reported either way)")
    parser.add_argument("--kill-at", type=positive_int, default=DEFAULT_KILL_AT, metavar="STEP",
                        help=f"step at which the fault fires (default {DEFAULT_KILL_AT})")


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.recovery.command``, ``benchmarks/bench_recovery.py``."""
    return standalone("memckpt bench recovery", __doc__, add_arguments, main, argv)


def main(args: argparse.Namespace) -> int:
    import psutil
    if args.dir:
        usable_dir(args.dir)
    target = int(args.state_mb * (1 << 20))
    need, avail = memory_needed(target), psutil.virtual_memory().available
    if need > avail:
        print(f"memckpt bench recovery: --state-mb {args.state_mb:g} needs about "
              f"{need / GIB:.1f} GiB of RAM, {avail / GIB:.1f} GiB are available: lower --state-mb",
              file=sys.stderr)
        return 1
    if args.gpt_steps < GPT_WARMUP_STEPS + 3 or args.kill_at < 2:
        print(f"memckpt bench recovery: need --gpt-steps >= {GPT_WARMUP_STEPS + 3} and "
              "--kill-at >= 2", file=sys.stderr)
        return 2
    try:
        rows = run_recovery_bench(args.state_mb, args.repeats, directory=args.dir,
                                  gpt_steps=args.gpt_steps, kill_at=args.kill_at,
                                  wait_quiet_s=args.wait_quiet)
    except Exception as e:  # noqa: BLE001 (a failed measurement is reported, exit 1)
        print(f"memckpt bench recovery: measurement failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return 1
    write_rows(args.json, rows)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
