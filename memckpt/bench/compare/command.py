"""Side by side: memckpt against torch.save, DCP async_save and Ray Train checkpoints.

Four parts (``--parts``, default all), each measured in this run, medians over repeats:

  stall      per-step stall of checkpointing every step, at each ``--sizes`` (params + AdamW
             state), with a fixed simulated forward+backward per step (``--step-s``, the same
             matmuls for every method). Stall = max(step-time increase over the same harness
             without checkpoints, the blocking part of the call): background work that steals
             the CPU shows up; the blocking part counts beyond the same harness's call
             without a checkpoint (Ray Train's report() alone waits for its controller's
             2 s poll). Methods: none, memckpt-local (RAM copy only), memckpt
             (memckpt.run, replication to a peer node's store every step), torch.save (local
             disk + fsync), dcp-async (the blocking part of dcp.async_save, incl. waiting for
             the previous save), ray-train (torch.save into a dir + ray.train.report); the
             physical limits in the same run: memcpy of the same tensors and one raw file
             write + fsync of the same bytes.
  lost_work  derived from the stall part (no extra measurement): per method, the smallest
             checkpoint interval N (steps) whose cost stays <= 5% of the step time, and the
             expected recomputed steps per failure, N/2 + the steps until a checkpoint is
             recoverable (replication / background write lag) (CheckFreq's and Gemini's
             argument)
  recovery   a 2-rank job (state per rank = each ``--recovery-sizes``) on a local 3-node Ray
             cluster, rank 1 SIGKILLed; fault -> every rank finished its first resumed step:
             memckpt from the local store and from a peer store (node removed)
             (memckpt.bench.recovery), restart every worker + torch.load, the same with DCP
             (dcp.save / dcp.load), and Ray Train restoring from its storage_path; the peer
             restore is also shown against a raw TCP transfer of the same bytes, and against
             restart + torch.load after the same node loss (rank 1's node removed: Ray must
             declare it dead before anyone restarts); ``--recovery-methods`` measures
             only some of them
  scaling    memckpt on ``--nodes`` simulated nodes (2,3,4) (one rank each, 1 torch thread,
             ``--scaling-size`` per rank), k = 1 and k = 2 replicas: stall, and the bytes each
             node's store holds (measured from the stores)

  peers      ``--peers torchft,dlrover`` (not part of ``--parts``; alone unless ``--parts`` is
             given too): memckpt beside torchft and DLRover flash checkpoint on one MLP, AdamW,
             the same seeds and data order, 2 ranks: the per-step blocking part, when the copy
             is usable, host RAM held per GiB of state, a rank SIGKILLed (time to the
             survivors' next step and to a step with every rank, steps lost, the final state
             bit for bit against an uninterrupted run), the whole job SIGKILLed
             (memckpt.bench.compare.peers). A peer that is not installed is named with why.

Sizes are binary (100M = 100 MiB). The simulated nodes are raylets on this one machine, so
every figure includes the CPU that replication and background writes take from training.
``--from-json A.json B.json`` merges rows of earlier (per-part) runs into one table and plot.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

# The measurements are in compare_measure (the methods themselves in alternatives), the rows
# and what is derived from them in compare_rows, the report in compare_report, the PNG in plot.
from memckpt.bench.common import (disk_dir, machine_info, parse_sizes, positive_int, ram_dir,
                                  standalone, usable_dir, write_rows)
from memckpt.bench.compare.measure import (SELECTABLE, measure_recovery, measure_scaling,
                                           measure_stall)
from memckpt.bench.compare.peers import PEERS, PeerSettings, run_peers
from memckpt.bench.compare.report import report
from memckpt.bench.compare.rows import PARTS, RECOVERY_METHODS, derive
from memckpt.bench.foreign_load import Quiet
from memckpt.bench.snapshot.measure import calibrate_compute
from memckpt.errors import ConfigError

DEFAULT_SIZES = "100M,1G"
DEFAULT_STEP_S = 1.0


def _log(msg: str) -> None:
    print(f"[bench compare] {msg}", file=sys.stderr, flush=True)


Size = tuple[str, int]  # (label as given, bytes), as parse_sizes returns it


@dataclass(frozen=True)
class CompareSettings:
    """What one ``memckpt bench compare`` run measures, and how long; validated here. A size
    left out takes its default from ``sizes`` (recovery: the largest; scaling: the smallest)."""

    parts: tuple[str, ...] = PARTS
    sizes: tuple[Size, ...] = ()  # stall: state per rank; () is DEFAULT_SIZES
    steps: int = 5  # stall: timed steps per method
    warmup: int = 2
    step_s: float = DEFAULT_STEP_S  # simulated forward+backward per step
    directory: Optional[str] = None  # local disk for the files; None: a temp dir
    ram_root: Optional[str] = None  # None: a temp dir on the shared-memory tmpfs, removed
    recovery_sizes: tuple[Size, ...] = ()
    recovery_repeats: int = 1
    recovery_compute_iters: int = 40
    kill_at: int = 4
    nodes: tuple[int, ...] = (2, 3, 4)  # scaling: simulated node counts
    scaling_size: Optional[Size] = None
    scaling_steps: Optional[int] = None  # None: ``steps``
    methods: tuple[str, ...] = SELECTABLE  # stall: the methods (baselines come along)
    recovery_methods: tuple[str, ...] = RECOVERY_METHODS
    raytrain_poll_s: Optional[float] = None  # None: Ray Train's own health-check interval
    peers: tuple[str, ...] = ()  # torchft, dlrover: the peers part (parts may then be empty)
    peer_settings: PeerSettings = PeerSettings()

    def __post_init__(self) -> None:
        for name, allowed in (("parts", PARTS), ("methods", SELECTABLE),
                              ("recovery_methods", RECOVERY_METHODS), ("peers", PEERS)):
            bad = [p for p in getattr(self, name) if p not in allowed]
            empty_ok = name == "peers" or (name == "parts" and self.peers)
            if bad or not (getattr(self, name) or empty_ok):
                raise ConfigError(f"CompareSettings.{name}={getattr(self, name)!r}: choose from "
                                  f"{','.join(allowed)}")
        for name, least in (("steps", 1), ("warmup", 0), ("recovery_repeats", 1),
                            ("recovery_compute_iters", 1), ("kill_at", 2)):
            if getattr(self, name) < least:
                raise ConfigError(f"CompareSettings.{name}={getattr(self, name)}: use {least} "
                                  "or more")
        if not self.nodes or min(self.nodes) < 2:
            raise ConfigError(f"CompareSettings.nodes={self.nodes}: give node counts of 2 or more")
        if not self.step_s > 0:
            raise ConfigError(f"CompareSettings.step_s={self.step_s}: use seconds > 0")
        sizes = tuple(self.sizes) or tuple(parse_sizes(DEFAULT_SIZES))
        object.__setattr__(self, "sizes", sizes)
        object.__setattr__(self, "recovery_sizes", tuple(self.recovery_sizes) or (sizes[-1],))
        object.__setattr__(self, "scaling_size", self.scaling_size or sizes[0])


def run_compare(s: CompareSettings = CompareSettings(), log: Callable[[str], None] = _log,
                cluster: Any = None) -> list[dict[str, Any]]:
    """Measure ``s.parts``; return the rows. ``cluster``: a LocalCluster the recovery and
    scaling parts use (left running; 3 nodes x 2 CPUs, at least ``max(s.nodes)`` nodes),
    else each starts its own."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    disk = disk_dir(s.directory, "memckpt-compare-")
    ram = Path(s.ram_root) if s.ram_root else ram_dir("memckpt-compare-")
    ram.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    try:
        compute_n, compute_alone = 0, 0.0
        if "stall" in s.parts or "scaling" in s.parts:
            calibrate_compute(s.step_s, Quiet())  # the first calibration runs cold: redo it
            _, compute_n, compute_alone = calibrate_compute(s.step_s, Quiet())
            log(f"simulated forward+backward: {compute_n} matmuls 256x256 = {compute_alone:.3f} s")
        if "stall" in s.parts:
            rows += measure_stall(list(s.sizes), s.steps, s.warmup, compute_n, disk, str(ram),
                                  s.raytrain_poll_s, log, s.methods)
        if "recovery" in s.parts:
            rows += measure_recovery(list(s.recovery_sizes), s.recovery_repeats, disk,
                                     s.raytrain_poll_s, s.recovery_compute_iters, s.kill_at, log,
                                     cluster, s.recovery_methods)
        if "scaling" in s.parts:
            assert s.scaling_size is not None  # filled in by CompareSettings
            rows += measure_scaling(s.scaling_size[1], s.scaling_size[0], list(s.nodes),
                                    s.scaling_steps or s.steps, s.warmup, compute_n, str(ram), log,
                                    cluster)
        if s.peers:
            rows += run_peers(s.peers, s.peer_settings, log, s.directory)
    finally:
        shutil.rmtree(disk, ignore_errors=True)
        if not s.ram_root:
            shutil.rmtree(ram, ignore_errors=True)
    info = machine_info()
    for r in rows:
        r["machine"] = info
        r["compute_matmuls"] = compute_n
        r["compute_alone_s"] = compute_alone
    log(f"measured in {time.time() - t0:.0f} s")
    return derive(rows)



# -- command line ---------------------------------------------------------------------------------
def _choice_list(allowed: tuple[str, ...], what: str) -> Callable[[str], tuple[str, ...]]:
    """argparse type: a comma-separated list of ``allowed`` names."""
    def parse(text: str) -> tuple[str, ...]:
        out = tuple(p.strip() for p in text.split(",") if p.strip())
        if not out or any(p not in allowed for p in out):
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: choose from "
                                             f"{','.join(allowed)}")
        return out
    return parse


def _node_counts(text: str) -> tuple[int, ...]:
    try:
        out = tuple(int(p) for p in text.split(","))
    except ValueError:
        out = ()
    if not out or min(out) < 2:
        raise argparse.ArgumentTypeError(f"invalid node counts {text!r}: e.g. 2,3,4 (each >= 2)")
    return out


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: seconds > 0")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", type=_choice_list(PARTS, "parts"), default=None, metavar="LIST",
                        help=f"what to measure, comma-separated (default {','.join(PARTS)}; "
                             "with --peers: none but the peers)")
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes(DEFAULT_SIZES),
                        metavar="LIST", help=f"stall: state sizes (default {DEFAULT_SIZES})")
    parser.add_argument("--methods", type=_choice_list(SELECTABLE, "methods"), default=SELECTABLE,
                        metavar="LIST",
                        help=f"stall: methods to measure (default all: {','.join(SELECTABLE)}; "
                             "each comes with its harness's no-checkpoint baseline)")
    parser.add_argument("--steps", type=positive_int, default=5, metavar="N",
                        help="stall: timed steps per method, after 2 warm-up steps (default 5)")
    parser.add_argument("--step-s", type=_seconds, default=DEFAULT_STEP_S, metavar="S",
                        help=f"simulated forward+backward per step (default {DEFAULT_STEP_S})")
    parser.add_argument("--recovery-sizes", type=parse_sizes, default=None, metavar="LIST",
                        help="recovery: state per rank (default: the largest of --sizes)")
    parser.add_argument("--recovery-repeats", type=positive_int, default=1, metavar="N")
    parser.add_argument("--recovery-methods", type=_choice_list(RECOVERY_METHODS, "recovery methods"),
                        default=RECOVERY_METHODS, metavar="LIST",
                        help=f"recovery: what to measure (default all: {','.join(RECOVERY_METHODS)})")
    parser.add_argument("--nodes", type=_node_counts, default=(2, 3, 4), metavar="LIST",
                        help="scaling: simulated node counts, each >= 2 (default 2,3,4; k=2 from 3)")
    parser.add_argument("--scaling-size", type=parse_sizes, default=None, metavar="SIZE",
                        help="scaling: state per rank (default: the smallest of --sizes)")
    parser.add_argument("--raytrain-poll-s", type=_seconds, default=None, metavar="S",
                        help="Ray Train controller poll interval (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S; "
                             "default: Ray's, 2 s)")
    parser.add_argument("--peers", type=_choice_list(PEERS, "peers"), default=(), metavar="LIST",
                        help=f"also measure these peers ({','.join(PEERS)}; pip install "
                             "'memckpt[peers]'); without --parts only them")
    parser.add_argument("--peer-size", type=parse_sizes, default=None, metavar="SIZE",
                        help="peers: params + AdamW state per rank (default 64M)")
    parser.add_argument("--peer-steps", type=positive_int, default=PeerSettings.steps,
                        metavar="N", help=f"peers: steps per run (default {PeerSettings.steps})")
    parser.add_argument("--peer-kill-step", type=positive_int, default=PeerSettings.kill_step,
                        metavar="N", help="peers: the step at which rank 1, and in another run "
                                          f"the whole job, is SIGKILLed (default "
                                          f"{PeerSettings.kill_step})")
    parser.add_argument("--peer-step-s", type=_seconds, default=PeerSettings.step_s, metavar="S",
                        help="peers: each step's forward+backward lasts S, padded by a sleep "
                             f"(default {PeerSettings.step_s}); torchft's restarted group must "
                             "rejoin before the last step")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="local-disk directory for the files (default: a temp dir on disk)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows to PATH")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write the plot to PNG")
    parser.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                        help="measure nothing: merge the rows of earlier --json files")


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.compare.command``, ``benchmarks/bench_compare.py``."""
    return standalone("memckpt bench compare", __doc__, add_arguments, main, argv)


def _read_rows(paths: list[str]) -> list[dict[str, Any]]:
    """The rows of earlier ``--json`` files (``--from-json``)."""
    rows: list[dict[str, Any]] = []
    for p in paths:
        try:
            more = json.loads(Path(p).read_text())
        except OSError as e:
            raise ConfigError(f"--from-json {p!r} is invalid: {e.strerror or e}") from None
        except ValueError as e:
            raise ConfigError(f"--from-json {p!r} is invalid: not JSON ({e})") from None
        if not isinstance(more, list) or not all(isinstance(r, dict) and "benchmark" in r
                                                 for r in more):
            raise ConfigError(f"--from-json {p!r} is invalid: not the rows of "
                              "`memckpt bench compare --json`")
        rows += more
    return rows


def _peer_settings(args: argparse.Namespace) -> PeerSettings:
    size = (args.peer_size or [("64M", 64 * 2**20)])[0]
    return PeerSettings(state_bytes=size[1], size_label=size[0], steps=args.peer_steps,
                        kill_step=args.peer_kill_step, job_kill_step=args.peer_kill_step,
                        step_s=args.peer_step_s)


def main(args: argparse.Namespace) -> int:
    if args.from_json:
        rows = derive(_read_rows(args.from_json))
    else:
        if args.dir:
            usable_dir(args.dir)
        try:
            parts = args.parts if args.parts is not None else (() if args.peers else PARTS)
            rows = run_compare(CompareSettings(
                parts, tuple(args.sizes), args.steps, 2, args.step_s, args.dir,
                recovery_sizes=tuple(args.recovery_sizes or ()),
                recovery_repeats=args.recovery_repeats, nodes=args.nodes,
                scaling_size=args.scaling_size[0] if args.scaling_size else None,
                raytrain_poll_s=args.raytrain_poll_s, methods=args.methods,
                recovery_methods=args.recovery_methods, peers=args.peers,
                peer_settings=_peer_settings(args)))
        except Exception as e:  # noqa: BLE001 (a failed measurement is reported, exit 1)
            print(f"memckpt bench compare: measurement failed: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return 1
    write_rows(args.json, rows, indent=1)
    if args.plot:
        from memckpt.bench.compare.plot import plot_compare
        plot_compare([r for r in rows if r["benchmark"] != "peers"], args.plot)
    print(report(rows))
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
