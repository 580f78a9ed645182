"""``memckpt status``: what a running job's coordinator knows, from another terminal."""

from __future__ import annotations

import argparse
import json
import time

from memckpt.errors import MemckptError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", default="memckpt", help="the job_name of the config (default memckpt)")
    parser.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    parser.add_argument("--json", action="store_true", help="print the raw status as JSON")


def fetch_status(job: str, address: str = "auto") -> dict:
    import ray

    from memckpt.coordinator import COORDINATOR_NAMESPACE, coordinator_name
    if not ray.is_initialized():
        ray.init(address=address, namespace=COORDINATOR_NAMESPACE, logging_level="ERROR",
                 log_to_driver=False)
    try:
        coord = ray.get_actor(coordinator_name(job), namespace=COORDINATOR_NAMESPACE)
    except ValueError:
        raise MemckptError(f"no running memckpt job named {job!r} on this cluster; pass --job "
                           "with the config's job_name") from None
    return ray.get(coord.status.remote(), timeout=30)


def main(args: argparse.Namespace) -> int:
    s = fetch_status(args.job, args.address)
    if args.json:
        print(json.dumps(s, indent=1, default=str))
        return 0
    print(f"job {args.job}: generation {s['gen']}, committed step {s['committed']}, "
          f"coordinator restarts {s['restarts_of_coordinator']}")
    print("placement (rank: node -> replica holders):")
    for rank, node in sorted(s["assignment"].items(), key=lambda kv: int(kv[0])):
        holders = ", ".join(h[:12] for h in s["holders"].get(rank, [])) or "(none)"
        print(f"  rank {rank}: {node[:12]} -> {holders}")
    now = time.time()
    for rank, m in sorted(s["metrics"].items(), key=lambda kv: int(kv[0])):
        print(f"  rank {rank}: step {m.get('step')}, snapshot stall {1000 * m.get('stall_s', 0):.1f} ms, "
              f"last report {now - m.get('time', now):.1f}s ago")
    return 0
