"""Worker processes kept between the jobs of one driver (:func:`keep_workers`).

A job's worker is a Ray actor that imported torch and warmed it up (~2-6 CPU-seconds, see
:func:`memckpt.runtime.worker.worker.warm_torch`); a job of 3 ranks with warm spares starts 6. A
driver that runs jobs one after another (a sweep, a reference run beside a faulted one, a
test suite) can keep the processes of a finished job for the next one instead: the next
job's ranks and spares take a kept process on their node with the same resources, which
forgets the old job (:meth:`memckpt.runtime.worker.worker.Worker.park`) and joins the new one
(:meth:`~memckpt.runtime.worker.worker.Worker.rebind`).

A kept process is the same Python process: what the training function left in module
globals or ``os.environ`` is still there for the next job (memckpt's own state is reset;
seed the RNGs in the training function, as every exact resume needs anyway).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

# A kept worker's shape: (CPUs, GPUs) its actor reserves. A rank's worker reserves the
# job's ``workers.cpus_per_worker``/``gpus_per_worker``; a spare reserves none.
Shape = tuple[float, float]


@dataclass
class KeptWorkers:
    """Idle workers of finished jobs, by node and shape, for this driver's next job."""

    job_id: str  # the Ray connection whose actors these are (see _connection)
    idle: dict[tuple[str, Shape], list[Any]] = field(default_factory=dict)

    def put(self, node: str, shape: Shape, worker: Any) -> None:
        self.idle.setdefault((node, shape), []).append(worker)

    def take(self, node: str, shape: Shape) -> Optional[Any]:
        found = self.idle.get((node, shape))
        return found.pop() if found else None

    def drain(self) -> list[Any]:
        """Every kept worker, no longer kept (for the caller to kill)."""
        out = [w for ws in self.idle.values() for w in ws]
        self.idle.clear()
        return out

    def __len__(self) -> int:
        return sum(len(ws) for ws in self.idle.values())


_kept: Optional[KeptWorkers] = None  # set inside keep_workers()


def current() -> Optional[KeptWorkers]:
    """The kept workers of this driver's Ray connection, or None outside
    :func:`keep_workers`. Those of an earlier connection are dropped: Ray ended them with
    it."""
    import ray

    global _kept
    if _kept is None or not ray.is_initialized():
        return None
    job = _connection()
    if _kept.job_id != job:
        _kept = KeptWorkers(job)
    return _kept


def _connection() -> str:
    """This driver's Ray connection: its job id within its cluster's session. A job id
    alone repeats (every new cluster's first driver is job 01000000), and a handle of
    the last cluster's actor cannot even be killed in the next."""
    import ray
    from ray._private import worker as ray_worker
    node = getattr(ray_worker.global_worker, "node", None)
    return f"{getattr(node, 'session_name', '')}/{ray.get_runtime_context().get_job_id()}"


@contextlib.contextmanager
def keep_workers() -> Iterator[None]:
    """Inside the block, a ``memckpt.run`` that finishes keeps its worker processes for
    the next ``memckpt.run`` of this process (see the module's docstring); leaving the
    block kills those still kept. While kept, a rank's worker holds the CPUs (and GPUs) it
    reserved: other Ray work on the cluster does not get them until the block ends or a
    job of another shape starts. Nested blocks share the outermost one's workers."""
    import ray

    global _kept
    if _kept is not None:
        yield
        return
    _kept = KeptWorkers(_connection() if ray.is_initialized() else "")
    try:
        yield
    finally:
        kept, _kept = current(), None
        for w in kept.drain() if kept is not None else []:
            ray.kill(w, no_restart=True)
