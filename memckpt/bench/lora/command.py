"""LoRA: what a snapshot costs when only the adapter changes.

A small Llama-shaped model (transformers' LlamaForCausalLM, grouped query attention) wrapped
with PEFT LoRA (r=8 on q_proj and v_proj) and trained by AdamW: the frozen base is over 90%
of what memckpt.TrainState(model, optimizer) captures. Four checkpointers snapshot the same
job at every step, in the same run:

  skip_unchanged="verify"  the default: a tensor unchanged since its slot last took it is not
                           copied (its version counter, storage and bytes compared)
  skip_unchanged="trust"   the same without the compare of the bytes
  skip_unchanged="off"     the whole state copied at every step
  trainable part alone     a TrainState of the trainable parameters and the optimizer only:
                           what checkpointing the adapter alone costs

Per step (medians after the warm-up snapshots): the time Checkpointer.step blocks the loop,
the bytes copied, the bytes sent to one replica holder (a real ReplicaStore reached over TCP,
as the runtime replicates every sealed step), and the RAM of the checkpointer's two slots
and of its holder's two replica slots.
Needs transformers and peft (pip install 'memckpt[hf]' peft).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from memckpt.bench.common import machine_info, positive_int, standalone, write_rows
from memckpt.bench.foreign_load import QUIET_THRESHOLD
from memckpt.errors import MemckptError

PRESET_NAMES = ("tiny", "small", "large")  # memckpt.bench.lora.llama.PRESETS, without torch


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=PRESET_NAMES, default="small",
                        help="the model: tiny (the smoke test's, ~6 MiB of state), small (the "
                             "default, ~75 MiB) or large (~0.6 GiB, the documented figures)")
    parser.add_argument("--steps", type=positive_int, default=20, metavar="N",
                        help="steps measured, after 3 warm-up snapshots (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="the job's seed (default 0)")
    parser.add_argument("--ram-root", metavar="DIR", default=None,
                        help="folder for the slots and the replica holders' copies (default "
                             "/dev/shm); a fresh folder inside it is removed afterwards")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help="on a shared machine: before each step's snapshots wait up to "
                             f"SECONDS for other processes to use < {QUIET_THRESHOLD * 100:.0f}%% "
                             "of the CPU (default 0: off)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as a JSON list to PATH")


def _say(msg: str) -> None:
    print(f"[bench lora] {msg}", file=sys.stderr, flush=True)


def cpu_model() -> Optional[str]:
    """The CPU's model name (Linux), as ``lscpu`` shows it."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def main(args: argparse.Namespace) -> int:
    if args.wait_quiet < 0:
        print("memckpt bench lora: --wait-quiet must be >= 0 seconds", file=sys.stderr)
        return 2
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"memckpt bench lora needs transformers and peft ({e}): "
              "pip install 'memckpt[hf]' peft", file=sys.stderr)
        return 2
    from memckpt.bench.lora.measure import LoraBench  # torch: not for --help
    from memckpt.bench.lora.report import report
    from memckpt.bench.lora.rows import derive
    try:
        with LoraBench(args.size, seed=args.seed, ram_base=args.ram_root, say=_say) as bench:
            bench.run(args.steps, args.wait_quiet)
            measured = bench.measured()
            job = bench.job
            p = job.preset
            described = (f"LlamaForCausalLM (hidden {p.hidden}, {p.layers} layers, {p.heads} "
                         f"heads / {p.kv_heads} key-value heads, vocab {p.vocab}) + LoRA r=8 on "
                         f"q_proj, v_proj; {job.params() / 1e6:.1f} M parameters, "
                         f"{job.trainable_params():,} trainable; batch {p.batch} × {p.seq} tokens")
            state_bytes, frozen = bench.state_bytes, bench.frozen_share
    except (MemoryError, RuntimeError, OSError, MemckptError) as e:
        print(f"memckpt bench lora: {e}", file=sys.stderr)
        return 1
    machine = dict(machine_info(), cpu_model=cpu_model())
    rows = derive(measured, args.size, state_bytes, frozen, machine)
    write_rows(args.json, [r.to_dict() for r in rows])
    print(report(rows, described))
    return 0


def _cli(argv: Optional[list[str]] = None) -> int:
    """``python -m memckpt.bench.lora.command``."""
    return standalone("memckpt bench lora", __doc__, add_arguments, main, argv)


if __name__ == "__main__":
    sys.exit(_cli())
