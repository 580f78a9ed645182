"""``memckpt ls ROOT`` and ``memckpt export ROOT [--step N] (--weights-only OUT | --dcp OUT_DIR)``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from memckpt.errors import ConfigError, NoSnapshotError


def _store(root: str):
    from memckpt.config import PersistTier
    from memckpt.persist import CheckpointStore
    try:
        return CheckpointStore(PersistTier(root))
    except ConfigError as e:
        fix = e.message.split(" is invalid: ", 1)[-1]
        raise ConfigError(f"ROOT {root!r} is invalid: {fix}") from None


def add_ls_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", help="a persistence root: a directory or s3://bucket/prefix")
    parser.add_argument("--verify", action="store_true",
                        help="also read every shard and check its checksums (slower)")
    parser.add_argument("--json", action="store_true", help="print JSON rows")


def ls_main(args: argparse.Namespace) -> int:
    store = _store(args.root)
    rows = []
    for info in store.list_checkpoints():
        status, reason = ("complete" if info.complete else "incomplete"), info.reason
        if info.complete and args.verify:
            problem = store.check(info.manifest)
            status, reason = ("corrupt", problem) if problem else ("verified", None)
        rows.append({"step": info.step, "folder": info.folder, "bytes": info.bytes,
                     "status": status, "reason": reason})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no checkpoints under {store.describe()}")
        return 0
    print(f"{'step':>10}  {'size':>10}  status      folder")
    for r in rows:
        size = f"{r['bytes'] / 2**20:.1f} MiB"
        print(f"{str(r['step']):>10}  {size:>10}  {r['status']:<10}  {r['folder']}"
              + (f"  ({r['reason']})" if r["reason"] else ""))
    return 0


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", metavar="ROOT", help="a persistence root: a directory or s3://bucket/prefix")
    parser.add_argument("--step", type=int, help="the step to export (default: the newest valid)")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--weights-only", metavar="OUT",
                      help="write the model's parameters here (.safetensors or .pt), whole "
                           "tensors even from a sharded (FSDP2/TP) checkpoint")
    what.add_argument("--dcp", metavar="OUT_DIR",
                      help="write a standard torch.distributed.checkpoint (DCP) checkpoint of "
                           "the model and optimizer here (keys: model.*, optim.*)")
    parser.add_argument("--model", help="with several models in the state, which one")


def export_main(args: argparse.Namespace) -> int:
    from memckpt.persist import export_weights
    flag, out = ("--dcp", args.dcp) if args.dcp else ("--weights-only", args.weights_only)
    if not Path(out).resolve().parent.is_dir():
        raise ConfigError(f"{flag} {out!r} is invalid: its folder does not exist")
    store = _store(args.root)
    if "://" not in args.root and not Path(args.root).is_dir():  # ls shows it as empty
        raise ConfigError(f"ROOT {args.root!r} is invalid: no such folder; give the root of "
                          "a persistence tier (its PersistTier uri) or s3://bucket/prefix")
    if args.step is None:
        manifest, reasons = store.latest_valid()
        if manifest is None:
            raise NoSnapshotError(f"no valid checkpoint under {store.describe()}: "
                                  + ("; ".join(reasons) or "it is empty"))
        for reason in reasons:  # newer checkpoints passed over for this one
            print(f"memckpt export: {reason}", file=sys.stderr)
    else:
        infos = [i for i in store.list_checkpoints() if i.step == args.step and i.complete]
        if not infos:
            steps = [i.step for i in store.list_checkpoints() if i.complete]
            raise NoSnapshotError(f"no complete checkpoint of step {args.step} under "
                                  f"{store.describe()}; complete steps: {steps}")
        manifest = infos[0].manifest
    if args.dcp:
        from memckpt.format.dcp_reader import MemckptReader
        from memckpt.persist.dcp_source import PersistedSource
        from memckpt.persist.export import export_dcp
        keys = export_dcp(MemckptReader(PersistedSource(store, manifest)), args.dcp)
        print(f"exported {len(keys)} entries of step {manifest.step} to {args.dcp} (DCP)")
        return 0
    fmt = "pt" if args.weights_only.endswith((".pt", ".pth", ".bin")) else "safetensors"
    keys = export_weights(manifest, args.weights_only, fmt=fmt, store=store, model=args.model)
    print(f"exported {len(keys)} tensors of step {manifest.step} to {args.weights_only} ({fmt})")
    return 0
