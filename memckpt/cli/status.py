"""``memckpt status``: what a running job's coordinator knows, from another terminal."""

from __future__ import annotations

import argparse
import json
import time

from memckpt.runtime.tools.job_client import fetch_status


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", default="memckpt", help="the job_name of the config (default memckpt)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")


def format_status(job: str, s: dict, now: float) -> str:
    """The human view of a coordinator's status (``memckpt status`` without ``--json``)."""
    lines = [f"job {job}: generation {s['gen']}, committed step {s['committed']}, "
             f"coordinator restarts {s['restarts_of_coordinator']}",
             "placement (rank: node -> replica holders):"]
    for rank, node in sorted(s["assignment"].items(), key=lambda kv: int(kv[0])):
        holders = ", ".join(h[:12] for h in s["holders"].get(rank, [])) or "(none)"
        lines.append(f"  rank {rank}: {node[:12]} -> {holders}")
    idle = sorted({h for hs in s["holders"].values() for h in hs} - set(s["assignment"].values()))
    if idle:  # placement.standby_nodes, or holders a recovery left without ranks
        lines.append("holding replicas, running no rank (take over a dead node's ranks): "
                     + ", ".join(n[:12] for n in idle))
    el = s.get("elastic")
    if el:
        lines.append(f"world size {el.get('world_size')} of {el.get('num_workers')} "
                     f"(min {el.get('min_workers')})")
        last = el.get("last_resize")
        if last:
            lines.append(f"last resize: from {last['from']} to {last['to']} ranks at step "
                         f"{last['step']} ({last['why']}); chunks from {last['sources']}")
        if el.get("pending_growth"):
            lines.append(f"pending growth: to {el['pending_growth']} ranks at the next "
                         "committed step (nodes with room appeared)")
    snaps = s.get("snapshots") or {}
    if snaps.get("requested") and snaps.get("landed", 0) < snaps["requested"]:
        # a user who asked for every step sees what they got (over the ranks, the whole job)
        lines.append(f"snapshots landed {int(snaps['landed'])} of {int(snaps['requested'])} "
                     f"due over the ranks ({int(snaps.get('skipped', 0))} skipped)")
    for rank, m in sorted(s["metrics"].items(), key=lambda kv: int(kv[0])):
        landed = ""
        if m.get("requested"):  # a user who asked for every step sees what they got
            landed = (f", snapshots landed {int(m.get('landed', 0))} of "
                      f"{int(m['requested'])}")
        lines.append(f"  rank {rank}: step {m.get('step')}, snapshot stall "
                     f"{1000 * m.get('stall_s', 0):.1f} ms{landed}, last report "
                     f"{now - m.get('time', now):.1f}s ago")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    s = fetch_status(args.job, args.address)
    if args.json:
        print(json.dumps(s, indent=1, default=str))
        return 0
    print(format_status(args.job, s, time.time()))
    return 0
