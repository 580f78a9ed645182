"""``memckpt status``: what a running job's coordinator knows, from another terminal."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Iterable, Mapping, Optional

from memckpt.policy.footprint import human_bytes
from memckpt.runtime.tools.job_client import fetch_rank_detail, fetch_status

if TYPE_CHECKING:  # the coordinator's answer, as the coordinator defines it
    from memckpt.runtime.coordinator.messages import CoordinatorStatus, NodeRam


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", default="memckpt", help="the job_name of the config (default memckpt)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")
    parser.add_argument("--ranks", action="store_true",
                        help="also ask every node's store for each of its ranks' step and last "
                             "sign of life (the coordinator keeps only nodes' and late ranks')")


def ram_line(held: int, budget: int) -> str:
    """A node's memckpt files against its ``Config.ram_budget``, as in "RAM held 1.50 GiB
    of budget 8.00 GiB (19%)"."""
    share = f" ({100 * held / budget:.0f}%)" if budget > 0 else ""
    return f"RAM held {human_bytes(held)} of budget {human_bytes(budget)}{share}"


def ram_lines(node_ram: Mapping[str, NodeRam], live: Optional[Iterable[str]] = None) -> list[str]:
    """One line per node of what memckpt holds in its RAM (the coordinator's ``node_ram``:
    node -> held, budget, peak bytes), the ``live`` nodes only when given."""
    keep = None if live is None else set(live)
    out = []
    for node, r in sorted(node_ram.items()):
        if keep is None or node in keep:
            peak = f", peak {human_bytes(r['peak'])}" if r.get("peak", 0) > r["held"] else ""
            out.append(f"  node {node[:12]}: {ram_line(r['held'], r['budget'])}{peak}")
    return out


def format_status(job: str, s: CoordinatorStatus, now: float) -> str:
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
    units = s.get("units") or {}
    if units:
        lines.append("progress per node (its ranks' latest step; a rank with no store alone):")
    for unit, m in sorted(units.items()):
        landed = ""
        if m.get("requested") and m.get("landed", 0) < m["requested"]:
            landed = (f", snapshots landed {int(m.get('landed', 0))} of "
                      f"{int(m['requested'])}")
        name = unit if unit.startswith("rank ") else f"node {unit[:12]}"
        lines.append(f"  {name} ({m['ranks']} rank{'s' if m['ranks'] != 1 else ''}): step "
                     f"{m['step']}, snapshot stall max {1000 * m['stall_max_s']:.1f} ms"
                     f"{landed}, last report {m.get('age_s', 0.0):.1f}s ago")
    late = s.get("heartbeats") or {}
    if late:
        lines.append("ranks late to beat: " + ", ".join(
            f"{r} ({v['age_s']:.1f}s, step {v['step']})"
            for r, v in sorted(late.items(), key=lambda kv: int(kv[0]))))
    # nodes that beat in this generation (a dead node's last figure is left out), measured
    # by their stores every few seconds
    ram = ram_lines(s.get("node_ram") or {}, s.get("node_beats") or None)
    if ram:
        lines += ["memckpt's host RAM per node (its files, against Config.ram_budget):"] + ram
    return "\n".join(lines)


def format_ranks(assignment: dict, detail: dict) -> str:
    """Each rank's step and last sign of life, as its node's store has them
    (``detail``: node -> {rank: (age, step)}, or the reason that store did not answer)."""
    lines = ["ranks (from their nodes' stores):"]
    for node, got in sorted(detail.items()):
        if isinstance(got, str):
            lines.append(f"  node {node[:12]}: {got}")
    for rank, node in sorted(assignment.items(), key=lambda kv: int(kv[0])):
        got = detail.get(node)
        if isinstance(got, dict) and int(rank) in got:
            age, step = got[int(rank)]
            lines.append(f"  rank {rank} on {node[:12]}: step {step}, last sign of life "
                         f"{age:.1f}s ago")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    s = fetch_status(args.job, args.address)
    ranks = fetch_rank_detail(s.get("stores") or {}) if args.ranks else None
    if args.json:  # --ranks: the stores' answers under "ranks", after the coordinator's keys
        print(json.dumps(s if ranks is None else dict(s, ranks=ranks), indent=1, default=str))
        return 0
    print(format_status(args.job, s, time.time()))
    if ranks is not None:
        print(format_ranks(s["assignment"], ranks))
    return 0
