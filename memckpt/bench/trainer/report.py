"""``memckpt bench trainer``'s ratios, table and targets (see its command's doc)."""

from __future__ import annotations

from statistics import median
from typing import Any

from memckpt.bench.common import finish_report, human_bytes, human_s, machine_line

BLOCKING_TARGET, RESTORE_TARGET = 10.0, 3.0  # x lower blocking at >= 1 GiB; x faster restore


def steady(values: list[float], skip: int = 1) -> float:
    """The median after the first ``skip`` (warm-up: the first step allocates and compiles)."""
    return float(median(values[skip:] if len(values) > skip else values))


def _pick(rows: list[dict[str, Any]], bench: str, size: str, method: str) -> dict[str, Any]:
    return next(r for r in rows if (r["benchmark"], r["size"], r["method"]) == (bench, size, method))


# memckpt's step row -> the framework's own checkpoint every step, in the same run
OWN_CHECKPOINT = {"memckpt": "hf-save", "memckpt-overlap": "hf-save",
                  "lightning-memckpt": "lightning-checkpoint"}
OWN_NAME = {"memckpt": "save_steps=1", "memckpt-overlap": "save_steps=1",
            "lightning-memckpt": "ModelCheckpoint(every_n_train_steps=1)"}


def ratios(rows: list[dict[str, Any]]) -> None:
    """Each memckpt row against the framework's own checkpoint, in place."""
    steps = {(r["size"], r["method"]): r for r in rows if r["benchmark"] == "step"}
    for (size, method), mc in steps.items():
        own = steps.get((size, OWN_CHECKPOINT.get(method, "")))
        if own is not None:
            mc["x_lower_blocking"] = own["blocking_s"] / max(mc["blocking_s"], 1e-9)
    for size in {r["size"] for r in rows}:
        mc_r = _pick(rows, "resume", size, "memckpt")
        for hf_method, suffix in (("hf-resume", ""), ("hf-resume-warm", "_warm")):
            hf_r = _pick(rows, "resume", size, hf_method)
            mc_r["x_faster_restore" + suffix] = hf_r["restore_s"] / max(mc_r["restore_s"], 1e-9)
            mc_r["x_faster_to_first_step" + suffix] = hf_r["to_first_step_s"] / mc_r["to_first_step_s"]


def report(rows: list[dict[str, Any]], machine: dict[str, Any]) -> str:
    text = [machine_line(machine, threads=True), "",
            "| size | per step | step time | blocked in checkpoint | vs the framework's own checkpoint |",
            "| --- | --- | --- | --- | --- |"]
    for r in (r for r in rows if r["benchmark"] == "step"):
        x = f"{r['x_lower_blocking']:.0f}x lower" if "x_lower_blocking" in r else ""
        text.append(f"| {human_bytes(r['state_bytes'])} | {r['method']} | {human_s(r['step_s'])} | "
                    f"{human_s(r['blocking_s'])} | {x} |")
    text += ["", "| size | resume | restore part | process start to first resumed step | restore vs "
                 "the Trainer's |", "| --- | --- | --- | --- | --- |"]
    for r in (r for r in rows if r["benchmark"] == "resume"):
        x = (f"{r['x_faster_restore']:.1f}x faster (page cache: "
             f"{r['x_faster_restore_warm']:.1f}x)" if "x_faster_restore" in r else "")
        text.append(f"| {human_bytes(r['state_bytes'])} | {r['method']} (step {r['resumed_step']}) | "
                    f"{human_s(r['restore_s'])} | {human_s(r['to_first_step_s'])} | {x} |")
    checks = []
    for r in rows:
        if r.get("state_bytes", 0) < 0.9 * 2**30 or r["method"] not in OWN_CHECKPOINT:
            continue
        if r["benchmark"] == "step":
            checks.append((r["x_lower_blocking"] >= BLOCKING_TARGET,
                           f"{human_bytes(r['state_bytes'])}: {r['method']} blocking per step "
                           f"{r['x_lower_blocking']:.0f}x lower than {OWN_NAME[r['method']]} "
                           f"(target >= {BLOCKING_TARGET:.0f}x)"))
        elif r["method"] == "memckpt":
            checks.append((r["x_faster_restore"] >= RESTORE_TARGET,
                           f"{human_bytes(r['state_bytes'])}: restore {r['x_faster_restore']:.1f}x "
                           f"faster than resume_from_checkpoint from the disk (target >= "
                           f"{RESTORE_TARGET:.0f}x; from the page cache: "
                           f"{r['x_faster_restore_warm']:.1f}x)"))
    return finish_report(text, rows, None, lambda r: r["method"], checks)
