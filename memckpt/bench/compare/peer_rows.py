"""The figures, rows and table of ``memckpt bench compare --peers`` (see :mod:`.peers`), from
the events the runs logged: one row per method (``benchmark="peers"``), a missing or failed
peer's row saying why."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from memckpt.bench.common import human_bytes, human_s, med
from memckpt.bench.compare.peer_jobs import RANKS

WARMUP = 2  # steps left out of the per-step medians

MODES = {
    "memckpt": "memckpt.Checkpointer, snapshot every step into /dev/shm (sync mode); the bench "
               "restarts every rank after a kill (as torchrun would), each restores from RAM",
    "dlrover": "flash checkpoint DdpCheckpointer, save_checkpoint(StorageType.MEMORY) every step, "
               "without dlrover-run (its saver is a daemon process of local rank 0); the bench "
               "restarts every rank after a kill (as torchrun would)",
    "torchft": "Manager (async quorum) + its Optimizer wrapper, gradients averaged by "
               "Manager.allreduce (0.2.0's DDP wrapper dies with the peer: assert fut._fut), "
               "2 replica groups of 1 rank over ProcessGroupGloo, PGTransport; lighthouse "
               "started by the bench; only the killed group restarts and heals from the live "
               "one; no copy of its own",
}


# -- comparing final states -------------------------------------------------------------------
def _equal(a: Any, b: Any) -> bool:
    """Bit for bit: tensors by their bytes (NaN-safe), containers element by element."""
    import torch  # here, not at the command line's start-up (tests/test_imports.py)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and
                a.dtype == b.dtype and a.shape == b.shape and
                torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                            b.reshape(-1).contiguous().view(torch.uint8)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return bool(a == b)


def same_final(ref_dir: Path, run_dir: Path, method: str,
               ranks: Optional[list[int]] = None) -> Optional[bool]:
    """Whether the final parameters and optimizer state of every rank in ``ranks`` (default:
    all) equal the reference's, bit for bit; None if a rank wrote none."""
    import torch
    try:
        return all(_equal(torch.load(ref_dir / f"{method}-r{r}.pt", weights_only=True),
                          torch.load(run_dir / f"{method}-r{r}.pt", weights_only=True))
                   for r in (range(RANKS) if ranks is None else ranks))
    except FileNotFoundError:
        return None


# -- the figures of one method ------------------------------------------------------------------
def _done(events: list[dict[str, Any]], rank: int = 0) -> dict[str, Any]:
    return next(e for e in reversed(events) if e["event"] == "done" and e["rank"] == rank)


def per_step(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Blocking part and copy-usable time (medians after warm-up, rank 0) and RAM held."""
    d = _done(events)
    b, u = d["blocking"][WARMUP:] or d["blocking"], d["usable"][WARMUP:] or d["usable"]
    return {"blocking_s": med(b), "usable_s": med(u) if u else None, "shm_bytes": d["ram_bytes"],
            "anon_bytes": d["anon"], "helper_bytes": d["children_anon"], "skipped": d["skipped"]}


def after_kill(events: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """From the events of a run with a kill (``kind``: ``kill`` or ``job_kill``)."""
    k = next(e for e in events if e["event"] == kind)
    t_kill, kill_step = k["t"], k["step"]
    later = [e for e in events if e["event"] == "step" and e["t"] > t_kill
             and e.get("committed", True)]
    survivors = [e for e in later if e["rank"] != k["rank"]]
    full = [e for e in later if e["participants"] == RANKS]
    # every rank has finished a step after the kill: the slowest rank's first one
    firsts = [t for t in (next((e["t"] for e in later if e["rank"] == r), None)
                          for r in range(RANKS)) if t is not None]
    every = max(firsts) if len(firsts) == RANKS else None
    if full:
        every = max(every or 0.0, full[0]["t"])
    restored = [e for e in events if e["event"] == "restored" and e["incarnation"] > 0]
    restored_step = min((e["step"] for e in restored), default=None)
    # steps whose work is lost: completed before the kill and not restored (plus the one
    # being computed, always); torchft: steps not committed after it
    rolled_back = (kill_step - 1 - restored_step) if restored_step is not None and \
        restored and restored[0].get("restore_s") else None
    uncommitted = sum(1 for e in events if e["event"] == "step" and e["t"] > t_kill
                      and e.get("committed") is False and e["rank"] != k["rank"])
    degraded = len({e["step"] for e in later if e["participants"] < RANKS})
    return {"kill_step": kill_step,
            "to_survivor_step_s": survivors[0]["t"] - t_kill if survivors else None,
            "to_every_rank_s": every - t_kill if every is not None else None,
            "restored_step": restored_step, "rolled_back_steps": rolled_back,
            "uncommitted_steps": uncommitted, "degraded_steps": degraded,
            "restore_s": max((float(e.get("restore_s") or 0.0) for e in restored), default=None)}


def ram_per_gib(shm: int, anon_extra: int, helper: int, state_bytes: int) -> float:
    """Host RAM held per GiB of state (GiB / GiB): shared-memory bytes allocated + the rank's
    anonymous memory beyond the baseline's + helper processes' (DLRover's saver)."""
    return (shm + max(0, anon_extra) + helper) / state_bytes


def _run_error(runs: dict[str, Any]) -> Optional[str]:
    errs = [f"{k}: {v['error']}" for k, v in runs.items() if "error" in v]
    return "; ".join(errs) or None


def method_rows(method: str, runs: dict[str, Any], base_anon: Optional[int],
                common: dict[str, Any], torchft_settings: Optional[dict[str, Any]],
                version_of: Callable[[str], Optional[str]]) -> list[dict[str, Any]]:
    from memckpt.version import __version__
    row: dict[str, Any] = dict(
        common, benchmark="peers", method=method, unit="s",
        figure="blocking part of the per-step call (median, rank 0)",
        version=__version__ if method == "memckpt" else version_of(method),
        mode=MODES[method], error=_run_error(runs), median=None)
    if torchft_settings:
        row["torchft_settings"] = torchft_settings
    ref = runs.get("reference", {})
    if "events" in ref:
        st = per_step(ref["events"])
        anon_extra = st["anon_bytes"] - base_anon if base_anon is not None else 0
        row.update(median=st["blocking_s"], blocking_s=st["blocking_s"], usable_s=st["usable_s"],
                   shm_bytes=st["shm_bytes"], anon_extra_bytes=anon_extra,
                   helper_bytes=st["helper_bytes"], skipped=st["skipped"],
                   ram_per_gib=ram_per_gib(st["shm_bytes"], anon_extra, st["helper_bytes"],
                                           common["state_bytes"]))
    for name in ("reference", "kill", "job_kill"):
        for why in runs.get(name, {}).get("failed_starts") or []:
            row.setdefault("failed_starts", []).append(f"{name}: {why}")
    for name in ("kill", "job_kill"):
        run = runs.get(name, {})
        if "events" in run and "events" in ref:
            try:
                row[name] = after_kill(run["events"], name)
            except StopIteration:
                row[name] = None
                row["error"] = (row["error"] or "") + f" {name}: no kill event logged"
            late = run.get("late") or []
            if row.get(name) is not None:
                row[name]["late_ranks"] = late
                row[name]["failed_starts"] = run.get("failed_starts") or []
            row[f"{name}_exact"] = same_final(ref["dir"], run["dir"], method,
                                              [r for r in range(RANKS) if r not in late])
    if method == "torchft":
        row["job_kill"] = None
        row["job_kill_note"] = ("no restore: torchft keeps no copy outside the live replica "
                                "groups (checkpointing to storage is left to the user)")
    return [row]


def missing_row(peer: str, why: str, common: dict[str, Any]) -> dict[str, Any]:
    return dict(common, benchmark="peers", method=peer, unit="s", median=None,
                figure="not measured", version=None, mode=MODES.get(peer, ""), error=why)


def _b(v: Optional[bool]) -> str:
    return "–" if v is None else ("yes" if v else "no")


def _kill(k: Optional[dict[str, Any]]) -> tuple[str, str, str]:
    if not k:
        return "–", "–", "–"
    lost = []
    if k.get("rolled_back_steps") is not None:
        lost.append(f"{k['rolled_back_steps']} rolled back")
    if k.get("uncommitted_steps"):
        lost.append(f"{k['uncommitted_steps']} not committed")
    if k.get("degraded_steps"):
        lost.append(f"{k['degraded_steps']} with 1 of 2 ranks")
    return human_s(k.get("to_survivor_step_s")), human_s(k.get("to_every_rank_s")), \
        ", ".join(lost) or "0"


def format_peers(rows: list[dict[str, Any]]) -> str:
    """The side by side: one line per method; then what did not run, and why."""
    lines = ["| method | version | blocking per step | copy usable after | RAM held per GiB "
             "of state | kill → survivors' next step | kill → step with every rank | steps "
             "lost | = uninterrupted | whole job killed: restored step, → every rank's step, "
             "= uninterrupted |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    order = {"memckpt": 0, "torchft": 1, "dlrover": 2}
    for r in sorted(rows, key=lambda r: order.get(r["method"], 9)):
        if r.get("blocking_s") is None and r.get("kill") is None:
            continue
        surv, every, lost = _kill(r.get("kill"))
        jk = r.get("job_kill")
        if jk:
            job = (f"step {jk['restored_step']} of {jk['kill_step']}, "
                   f"{human_s(jk['to_every_rank_s'])}, {_b(r.get('job_kill_exact'))}")
            if jk.get("failed_starts"):
                job += f" ({len(jk['failed_starts'])} failed restart(s))"
        else:
            job = "none (no copy of its own)" if r["method"] == "torchft" else "–"
        usable = human_s(r.get("usable_s")) if r.get("usable_s") is not None else (
            "no copy (live peer)" if r["method"] == "torchft" else "–")
        ram = "–" if r.get("ram_per_gib") is None else (
            f"{r['ram_per_gib']:.2f} GiB (copy {r['shm_bytes'] / r['state_bytes']:.2f}, "
            f"processes +{human_bytes(max(0, r['anon_extra_bytes']) + r['helper_bytes'])})")
        lines.append(f"| {r['method']} | {r.get('version') or '–'} | {human_s(r.get('blocking_s'))} "
                     f"| {usable} | {ram} | {surv} | {every} | {lost} | {_b(r.get('kill_exact'))} "
                     f"| {job} |")
    head = rows[0]
    out = [f"peers: {head['size']} per rank ({human_bytes(head['state_bytes'])} params + AdamW "
           f"moments), {head['settings']['ranks']} ranks, {head['settings']['steps']} steps, "
           f"rank 1 SIGKILLed at step {head['settings']['kill_step']}; CPU: {head['cpu_model']}",
           "", "\n".join(lines)]
    for r in rows:
        if r.get("error"):
            out.append(f"- {r['method']}: NOT measured in full: {r['error']}")
        for why in r.get("failed_starts") or []:
            out.append(f"- {r['method']}: a start failed, every rank restarted (as torchrun "
                       f"--max-restarts would): {why}")
        for name in ("kill", "job_kill"):
            k = r.get(name) or {}
            if k.get("late_ranks"):
                out.append(f"- {r['method']} {name}: rank(s) {k['late_ranks']} restarted too late "
                           "to rejoin before the last step; stopped (compared: the others)")
        if r.get("mode") and r.get("blocking_s") is not None:
            out.append(f"- {r['method']}: {r['mode']}")
        if r.get("torchft_settings"):
            out.append("- torchft settings: " + ", ".join(f"{k}={v}" for k, v in
                                                         r["torchft_settings"].items()))
    return "\n".join(out)
