"""``memckpt demo``: train, inject a fault, recover, and show the run is unchanged.

Modes:

* ``--local``: the single-process demo (:mod:`memckpt.demo.single_process`): no Ray, one
  training process SIGKILLed and a new one restored from the RAM snapshot.
* default: the multi-node Ray demo (:mod:`memckpt.demo.ray_demo`): 3 simulated
  nodes, DDP + ZeRO (``--model fsdp``: FSDP2), ``--fault worker|node|store|coordinator|none``,
  then the uninterrupted reference run for comparison.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from memckpt.demo.single_process import DEFAULT_SIZE, DEFAULT_STEPS, default_kill_at, run_local

FAULTS = ("worker", "node", "store", "coordinator", "cluster", "none")
MODELS = ("ddp", "fsdp")  # memckpt.demo.job.GPTJob, FSDPJob
RAY_STEPS = 20  # the README command: about 1.5 minutes on 2 cores
ELASTIC_STEPS = 40  # room for a node to be added back and the job to grow

RAY_SIZE = "tiny"  # the multi-node demo's default: 3 ranks share 2 cores
SIZES = ("tiny", "mini", "small")  # memckpt.demo.model.PRESETS, without importing torch here


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is invalid: use a whole number >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--local", action="store_true",
                        help="single-process demo without Ray: SIGKILL the training process, "
                             "restore a new one from the RAM snapshot")
    parser.add_argument("--fault", choices=FAULTS, default="worker",
                        help="multi-node demo: what to kill mid-run (default worker; none is "
                             "the uninterrupted reference run)")
    parser.add_argument("--s3", metavar="URI",
                        help="with --fault cluster: also persist to this s3://bucket/prefix "
                             "(endpoint and credentials from the AWS environment)")
    parser.add_argument("--elastic", action="store_true",
                        help="with --fault node: 3 one-rank nodes and no spare room; the job "
                             "goes on with 2 ranks from RAM, then grows back to 3 when a node "
                             "is added")
    parser.add_argument("--no-compare", dest="compare", action="store_false",
                        help="multi-node demo: skip the uninterrupted reference run")
    parser.add_argument("--steps", type=_positive_int, default=None, metavar="N",
                        help=f"training steps (default {DEFAULT_STEPS} local, "
                             f"{RAY_STEPS} multi-node, {ELASTIC_STEPS} --elastic)")
    parser.add_argument("--kill-at", type=_positive_int, default=None, metavar="K",
                        help="SIGKILL the training process right after step K, 1 <= K < N "
                             "(default: --local about a third in, "
                             f"{default_kill_at(DEFAULT_STEPS)} of {DEFAULT_STEPS}; multi-node "
                             "half way; --elastic a quarter)")
    parser.add_argument("--summary", metavar="PATH",
                        help="also write the result (losses, digests, recoveries) as JSON")
    parser.add_argument("--size", choices=SIZES, default=None,
                        help=f"model preset: tiny ~0.1M, mini ~4M, small ~14M parameters "
                             f"(default tiny multi-node, {DEFAULT_SIZE} --local; mini is about "
                             "10x slower a step on 2 cores, small 30x)")
    parser.add_argument("--tiny", action="store_true", help="same as --size tiny")
    parser.add_argument("--seed", type=int, default=0, help="model, data and shuffle seed")
    parser.add_argument("--model", choices=MODELS, default="ddp",
                        help="multi-node demo: train the GPT with DDP + ZeRO (default) or "
                             "sharded with FSDP2 on a CPU mesh (DTensor state)")
    parser.set_defaults(_demo_parser=parser)


def _validate(args: argparse.Namespace) -> None:
    parser: argparse.ArgumentParser = args._demo_parser
    if args.steps is None:
        args.steps = (DEFAULT_STEPS if args.local else
                      ELASTIC_STEPS if args.elastic else RAY_STEPS)
    if args.steps < 2:
        parser.error(f"argument --steps: {args.steps} is too few: the demo needs at least 2 steps")
    if args.kill_at is not None and not 1 <= args.kill_at <= args.steps - 1:
        parser.error(f"argument --kill-at: {args.kill_at} is out of range: kill between step 1 "
                     f"and step {args.steps - 1} (--steps is {args.steps})")
    if args.s3 and (args.local or args.fault != "cluster"):
        parser.error("argument --s3: only with --fault cluster")
    if args.s3:
        from memckpt.config import PersistTier
        from memckpt.errors import ConfigError
        try:
            PersistTier(args.s3)
        except ConfigError as e:
            parser.error(f"argument --s3: {e}")
    if args.local and args.model != "ddp":
        parser.error(f"argument --model: {args.model} runs in the multi-node demo; "
                     "leave out --local")
    if args.elastic and (args.local or args.fault != "node" or args.model != "ddp"):
        parser.error("argument --elastic: only with --fault node and --model ddp "
                     "(the multi-node demo)")
    if args.tiny and args.size not in (None, "tiny"):
        parser.error(f"argument --tiny: not allowed with --size {args.size}")
    if args.summary:  # its folder is made if missing: the nearest existing one must allow it
        folder = Path(args.summary).resolve().parent
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
            parser.error(f"argument --summary: {args.summary!r} is invalid: {folder} is not a "
                         "folder this process may write in")


def _run_local(args: argparse.Namespace) -> int:
    return run_local(steps=args.steps, kill_at=args.kill_at, summary=args.summary,
                     tiny=args.tiny, size=args.size, seed=args.seed)


def _run_ray(args: argparse.Namespace) -> int:
    from memckpt.demo.ray_demo import run_ray_demo
    size = "tiny" if args.tiny else (args.size or RAY_SIZE)
    return run_ray_demo(fault=args.fault, steps=args.steps, kill_at=args.kill_at, size=size,
                        summary=args.summary, compare=args.compare, seed=args.seed,
                        s3=args.s3, model=args.model, elastic=args.elastic)


def _timeline(job: str) -> None:
    """The elastic demo's picture: loss, failures and the world size over the steps."""
    from memckpt.cli.report import draw, load_timeline
    from memckpt.runtime.driver.driver import default_run_dir
    run_dir = default_run_dir(job)
    draw(load_timeline(run_dir), run_dir / "timeline.png")
    print(f"timeline (world size over the steps): {run_dir / 'timeline.png'}; "
          f"redraw with `memckpt report {run_dir}`", flush=True)


def main(args: argparse.Namespace) -> int:
    _validate(args)
    if args.local:
        return _run_local(args)
    rc = _run_ray(args)
    if args.elastic:
        from memckpt.demo.ray_demo import ELASTIC_JOB
        _timeline(ELASTIC_JOB)
    return rc
