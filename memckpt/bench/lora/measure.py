"""The measurement of ``memckpt bench lora``: one LoRA job, four checkpointers side by side.

Every step the job trains once, then each variant in turn (the order rotates from step to
step, so no variant always comes first after the update) takes its snapshot with
``Checkpointer.step`` (timed: what the training loop waits for), waits for the seal, and
replicates the sealed step to its own replica holder: a real :class:`ReplicaStore` in this
process, reached through a real :class:`StoreConnection` over TCP on the loopback, sent as the
runtime's replicator sends (the shard's raw bytes, its data checksum, the generation, its
chunk table). Each variant has its own holder, so no holder fills one variant's replica from
another's.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from memckpt.bench.foreign_load import Quiet
from memckpt.bench.lora.llama import PRESETS, LoraJob, TrainableOnly
from memckpt.checkpointer import Checkpointer
from memckpt.config import Config, EngineConfig
from memckpt.engine.buffers import allocated_bytes
from memckpt.format.state import TrainState
from memckpt.runtime.node.replica_store import ReplicaStore
from memckpt.runtime.wire.data_plane import StoreConnection

# snapshots left out of the medians: the first two fill both slots (and both replica slots);
# the third is the first to find its slot's tensors where it left them
WARMUP = 3
GEN = 0  # the generation the replicas are sent under (one, the job never recovers)

# (variant, skip_unchanged, whole job or the trainable part alone)
VARIANTS: tuple[tuple[str, str, bool], ...] = (
    ("verify", "verify", True), ("trust", "trust", True), ("off", "off", True),
    ("trainable", "verify", False))


@dataclass
class Variant:
    """One checkpointer of the job and its replica holder; what each step measured."""
    name: str
    skip_unchanged: str
    whole: bool  # the whole job's state, or the trainable part alone
    state: TrainState
    ckpt: Checkpointer
    store: ReplicaStore
    conn: StoreConnection
    steps: list[dict[str, Any]] = field(default_factory=list)

    def snapshot(self, step: int) -> None:
        """Snapshot ``step``, seal it, send it to the holder; record what each part took."""
        t0 = time.perf_counter()
        took = self.ckpt.step(self.state, step)
        blocked = time.perf_counter() - t0
        if not took:
            raise RuntimeError(f"{self.name}: the snapshot of step {step} was skipped")
        stats = self.ckpt.stats
        copied, unchanged, stall = stats.last_copied_bytes, stats.last_unchanged_bytes, stats.last_stall_s
        self.ckpt.wait()
        with self.ckpt.engine.reading(step, verify=False) as shard:
            t1 = time.perf_counter()
            sent = self.conn.send(0, step, shard.raw, shard.header["data_xxh3"], GEN,
                                  chunks=shard.chunks)
            send_s = time.perf_counter() - t1
            shard_bytes = len(shard.raw)
        self.steps.append(dict(step=step, blocked_s=blocked, stall_s=stall, seal_s=stats.last_seal_s,
                               copied_bytes=copied, unchanged_bytes=unchanged, sent_bytes=sent,
                               send_s=send_s, shard_bytes=shard_bytes))

    def close(self) -> None:
        self.conn.close()
        self.store.clear()
        self.ckpt.close(unlink=True)


class LoraBench:
    """The job of ``preset`` and its four variants, in RAM under a fresh folder of
    ``ram_base`` (/dev/shm where writable); a context manager that removes it all."""

    def __init__(self, preset: str, seed: int = 0, ram_base: Optional[str] = None,
                 say: Callable[[str], None] = lambda _: None) -> None:
        self.say = say
        self.preset_name = preset
        t0 = time.perf_counter()
        self.job = LoraJob(PRESETS[preset], seed)
        self.job.step()  # AdamW's moments exist from here on: every snapshot has one layout
        self.step = 1
        # other processes' share of the CPU while the snapshots were taken; steps whose wait
        # for a quiet machine timed out
        self.foreign_cpu: Optional[float] = None
        self.quiet_timeouts = 0
        whole = TrainState(model=self.job.model, optimizer=self.job.optimizer)
        self.state_bytes = whole.capture(0).nbytes
        self.frozen_share = self.job.frozen_bytes() / self.state_bytes
        base = ram_base or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
        self.root = Path(tempfile.mkdtemp(prefix="memckpt-bench-lora-", dir=base))
        self.variants: dict[str, Variant] = {}
        try:
            for name, mode, is_whole in VARIANTS:
                self.variants[name] = self._variant(name, mode, is_whole)
        except BaseException:
            self.close()
            raise
        say(f"{preset}: {self.job.params() / 1e6:.1f} M parameters, "
            f"{self.job.trainable_params():,} trainable (LoRA r={self.job.model.peft_config['default'].r}); "
            f"state {self.state_bytes / (1 << 20):.1f} MiB, frozen base "
            f"{100 * self.frozen_share:.2f}% of it; built in {time.perf_counter() - t0:.1f} s")

    def _variant(self, name: str, mode: str, whole: bool) -> Variant:
        model = self.job.model if whole else TrainableOnly(self.job.model)
        state = TrainState(model=model, optimizer=self.job.optimizer)
        ckpt = Checkpointer(Config(job_name=f"lora-{name}", ram_root=str(self.root / "ranks"),
                                   engine=EngineConfig(skip_unchanged=mode)))
        store: Optional[ReplicaStore] = None
        try:
            ckpt.restore(state)  # nothing to restore: maps both slots in the background
            ckpt.engine.wait_prepared()
            store = ReplicaStore(ram_root=str(self.root / "holders"), job="lora",
                                 node_id=f"holder-{name}")
            conn = StoreConnection(store.address("127.0.0.1"), timeout_s=60)
        except BaseException:
            if store is not None:
                store.clear()
            ckpt.close(unlink=True)
            raise
        return Variant(name, mode, whole, state, ckpt, store, conn)

    def run(self, steps: int, wait_quiet: float = 0.0) -> None:
        """``WARMUP + steps`` training steps, each snapshotted by every variant; with
        ``wait_quiet`` > 0, each step's snapshots wait (that long at most) for other
        processes to leave the CPU first."""
        order = list(self.variants.values())
        settle, quiet = Quiet(wait_quiet), Quiet()
        for i in range(WARMUP + steps):
            self.job.step()
            self.step += 1
            settle.settle()
            with quiet.span():
                for k in range(len(order)):
                    order[(i + k) % len(order)].snapshot(self.step)
            quiet.keep()
            if i == 0:  # the frozen base's pages collapsed before the warm-up's other steps
                for v in order:
                    if v.ckpt.engine.watch is not None:
                        v.ckpt.engine.watch.wait_ready()
            if i + 1 == WARMUP or (i + 1 - WARMUP) % 5 == 0:
                self.say(f"{i + 1} of {WARMUP + steps} steps (loss {self.job.losses[-1]:.4f})")
        self.foreign_cpu = quiet.foreign()
        self.quiet_timeouts = settle.timeouts

    def measured(self) -> list[dict[str, Any]]:
        """One dict per variant: its steady steps' records and its slots' RAM."""
        out = []
        for v in self.variants.values():
            out.append(dict(variant=v.name, skip_unchanged=v.skip_unchanged, whole=v.whole,
                            state_bytes=v.state.capture(0).nbytes, steps=v.steps[WARMUP:],
                            warmup=WARMUP, ram_bytes=allocated_bytes(v.ckpt.directory),
                            holder_bytes=allocated_bytes(v.store.replicas),
                            foreign_cpu=self.foreign_cpu, quiet_timeouts=self.quiet_timeouts))
        return out

    def close(self) -> None:
        for v in self.variants.values():
            v.close()
        self.variants = {}
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LoraBench":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
