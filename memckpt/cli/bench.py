"""``memckpt bench BENCHMARK ...``: one sub-command per benchmark.

Add a benchmark by writing a module with ``add_arguments(parser)`` and
``main(args) -> int`` and naming it in :data:`BENCHMARKS`; it becomes
``memckpt bench NAME``. Exit codes follow ``memckpt``: 0 measured, 1 a
measurement failed, 2 bad usage.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Callable

# name -> (module with `add_arguments(parser)` and `main(args) -> int`, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "snapshot": ("memckpt.bench.snapshot.command",
                 "per-step stall of a snapshot: memckpt (sync, overlap) vs memcpy vs torch.save"),
    "train-overhead": ("memckpt.bench.train_overhead.command",
                       "a compute-bound loop with a snapshot every step: step time vs none, per "
                       "mode and seal policy; snapshots landed"),
    "persist": ("memckpt.bench.persist.command",
                "persistence throughput: memckpt's disk / S3 tier vs a raw write of the same bytes"),
    "recovery": ("memckpt.bench.recovery.command",
                 "recovery after a killed worker / node vs restart + torch.load; transfer; step time"),
    "fsdp-stall": ("memckpt.bench.fsdp_stall.command",
                   "snapshot stall of an FSDP2 job vs a raw copy of each rank's local bytes"),
    "compare": ("memckpt.bench.compare.command",
                "side by side: memckpt vs torch.save, DCP async_save, Ray Train (stall, recovery, "
                "lost work, scaling)"),
    "ray-train": ("memckpt.bench.ray_train.command",
                  "inside Ray Train: memckpt's snapshot vs ray.train.report(checkpoint=...); "
                  "recovery after a killed worker"),
    "elastic": ("memckpt.bench.elastic.command",
                "elastic shrink: node death -> first step at fewer ranks, RAM reshard vs restart "
                "+ DCP load"),
    "reshard": ("memckpt.bench.reshard.command",
                "restore FSDP2 state of 4 ranks into 2 and 3 (disk, RAM) vs dcp.load of the same"),
    "control-plane": ("memckpt.bench.control_plane.command",
                      "the real coordinator in its own process, driven as a job drives it "
                      "(one Uplink a node, held commit waits, the driver's polls, pickled "
                      "calls) at 1,024..16,384 simulated ranks: CPU, messages and bytes per "
                      "step, commit latency, plan time"),
    "trainer": ("memckpt.bench.trainer.command",
                "the Hugging Face Trainer: save_steps=1 vs memckpt every step; "
                "resume_from_checkpoint vs memckpt's resume"),
    "lora": ("memckpt.bench.lora.command",
             "a PEFT LoRA job: blocking time, bytes copied and sent per step with skip_unchanged "
             "verify / trust / off vs the trainable part alone"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, title="benchmarks")
    for name, (module, help_text) in BENCHMARKS.items():
        mod = importlib.import_module(module)
        p = sub.add_parser(name, help=help_text, description=(mod.__doc__ or help_text).strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_bench_main=mod.main)


def main(args: argparse.Namespace) -> int:
    handler: Callable[[argparse.Namespace], int] = args._bench_main
    return handler(args)
