"""The Ray actors of ``memckpt bench recovery`` (:mod:`memckpt.bench.recovery`) besides
memckpt's own: the alternative it is measured against, and the raw transfers that are the
limit of its peer fetch and replication.

  ColdWorker    a plain training rank: torch.save to local disk, train until the peer
                fails, and on restart (a new, cold process) torch.load + one step
  RawSender     sendall of a preallocated array to a RawReceiver
  RawReceiver   recv_into a preallocated buffer, then an ack
  PathClient    memckpt's own transfer path with nothing else running: a shard streamed
                into a peer's ReplicaStore (verified there) and fetched back

``ray.remote(cls)`` pickles these classes by reference: they stay at module top level.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from memckpt.bench.common import evict_from_page_cache
from memckpt.bench.recovery.workload import (all_reduce_mean, build_state, compute_inputs,
                                        compute_loss)

if TYPE_CHECKING:
    import torch


def _as_address(address: Sequence[Any]) -> tuple[str, int]:
    """``address`` as a (host, port) tuple, whatever sequence it came as (hashable: a key)."""
    host, port = address
    return host, port


# -- the alternative: restart every worker and torch.load ---------------------------------------
_GROUP_TIMEOUT_S = 60


def _init_group(master: tuple[str, int], rank: int, world: int, held: Any) -> None:
    import datetime

    import torch.distributed as dist

    from memckpt.runtime.worker import rendezvous
    timeout = datetime.timedelta(seconds=_GROUP_TIMEOUT_S)
    dist.init_process_group("gloo", store=rendezvous.join(master, rank, held, timeout),
                            rank=rank, world_size=world, timeout=timeout)


class ColdWorker:
    """A plain Ray actor training rank: a new one is a cold process that imports torch."""

    def __init__(self, cpus: int) -> None:
        import torch
        torch.set_num_threads(max(1, cpus))
        self.model: Optional[torch.nn.Module] = None
        self.opt: Optional[torch.optim.Optimizer] = None
        self._rendezvous: Any = None  # the group's store, as rank 0 (address())

    def address(self) -> tuple[str, int]:
        """As rank 0: the group's store, listening from now on (as memckpt's workers do)."""
        import datetime

        import ray

        from memckpt.runtime.worker import rendezvous
        ip = ray.util.get_node_ip_address()
        self._rendezvous = rendezvous.host(ip, datetime.timedelta(seconds=_GROUP_TIMEOUT_S))
        return ip, self._rendezvous.port

    def save_checkpoint(self, path: str, d: int, n: int, seed: int) -> int:
        """Build the state and torch.save it to local disk, fsynced, then drop the file from
        the page cache so the restart really reads the disk."""
        import torch
        model, opt = build_state(d, n, fresh=True, seed=seed)
        self.model, self.opt = model, opt
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        return evict_from_page_cache(Path(path))

    def train(self, master: tuple[str, int], rank: int, world: int, kill_at: Optional[int],
              marker: str, compute_iters: int, max_steps: int = 10_000,
              hold: bool = False) -> int:
        """Train until the peer fails; at ``kill_at`` write the time and SIGKILL this process,
        or with ``hold`` stay still there until the driver removes this process's node."""
        _init_group(master, rank, world, self._rendezvous)
        x, w = compute_inputs()
        for step in range(1, max_steps + 1):
            loss = all_reduce_mean(compute_loss(x, w, compute_iters), world)
            float(loss)
            if step == kill_at:
                with open(marker, "w") as f:
                    f.write(repr(time.time()))
                if hold:
                    time.sleep(3600)
                os.kill(os.getpid(), signal.SIGKILL)
        return max_steps

    def restore_and_step(self, path: str, master: tuple[str, int], rank: int, world: int,
                         d: int, n: int, compute_iters: int) -> dict[str, float]:
        import torch
        t0 = time.time()
        _init_group(master, rank, world, self._rendezvous)
        t1 = time.time()
        model, opt = build_state(d, n, fresh=False)
        t2 = time.time()
        sd = torch.load(path, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        del sd
        t3 = time.time()
        x, w = compute_inputs()
        loss = compute_loss(x, w, compute_iters)
        t4 = time.time()
        float(all_reduce_mean(loss, world))
        t5 = time.time()
        self.model, self.opt = model, opt
        return {"process_group": t1 - t0, "build": t2 - t1, "torch_load": t3 - t2,
                "compute": t4 - t3, "t_start": t0, "t_all_reduce": t4, "t_done": t5}


# -- raw transfer -------------------------------------------------------------------------------
class RawSender:
    def __init__(self, nbytes: int) -> None:
        import numpy as np
        self.array = np.ones(nbytes, dtype=np.uint8)  # allocated and touched up front

    def ready(self) -> bool:
        return True

    def send_tcp(self, address: tuple[str, int]) -> float:
        """sendall the array to a :meth:`RawReceiver.receive_tcp`; returns connect -> ack."""
        import socket
        t0 = time.perf_counter()
        with socket.create_connection(_as_address(address)) as s:
            s.sendall(memoryview(self.array))
            s.recv(1)  # the receiver's ack: every byte has landed
        return time.perf_counter() - t0


class RawReceiver:
    def ready(self) -> bool:
        return True

    def listen(self, nbytes: int) -> tuple[str, int]:
        import socket

        import numpy as np
        import ray
        self.buf = np.ones(nbytes, dtype=np.uint8)  # allocated and touched up front
        self.srv = socket.create_server((ray.util.get_node_ip_address(), 0))
        return self.srv.getsockname()[:2]

    def receive_tcp(self) -> float:
        """The raw limit of memckpt's replication path: recv_into a preallocated buffer."""
        conn, _ = self.srv.accept()
        with conn:
            t0 = time.perf_counter()
            view, got = memoryview(self.buf), 0
            while got < len(view):
                n = conn.recv_into(view[got:])
                if n == 0:
                    raise ConnectionError("raw sender closed early")
                got += n
            conn.sendall(b"k")
        self.srv.close()
        return time.perf_counter() - t0


# -- memckpt's own transfer path, with nothing else running ------------------------------------
class PathClient:
    """A rank's side of memckpt's transfer path, without a training job around it: streams a
    sealed shard into a peer's
    :class:`~memckpt.runtime.node.replica_store.ReplicaStore` as replication does (the
    store writes it into its slot file and verifies it before it acks), and fetches one back
    as a peer restore does (into a preallocated buffer; a restore verifies afterwards)."""

    def __init__(self, nbytes: int, rank: int) -> None:
        import numpy as np

        from memckpt.format import shard as fmt
        layout = fmt.Layout((fmt.TensorEntry("data", "uint8", (nbytes,), 0, nbytes),), nbytes)
        self.rank, self.layout = rank, layout
        self.cap = fmt.header_capacity_for(layout)
        self.region = np.ones(fmt.region_size(layout, self.cap), dtype=np.uint8)  # touched
        self.landing = np.ones_like(self.region)  # where fetches land, touched up front
        self._conns: dict = {}

    def ready(self) -> bool:
        return True

    def send(self, address: tuple[str, int], step: int) -> float:
        """Seal ``step`` (untimed: the snapshot does that) and replicate it; seconds from the
        first byte to the store's verified ack, over a kept connection as the Replicator."""
        from memckpt.format import shard as fmt
        from memckpt.runtime.wire.data_plane import StoreConnection
        # a byte of every page changes with the step, as training changes every tensor: a
        # holder leaves in place only the chunks its copy already has (#50), and the same
        # bytes again would cross as a header alone
        self.region[fmt.data_offset(self.cap)::4096] = step % 251
        digest = fmt.seal(self.region, self.layout, self.cap, step, {})
        address = _as_address(address)
        conn = self._conns.get(address)
        if conn is None:
            conn = self._conns[address] = StoreConnection(address)
        t0 = time.perf_counter()
        if not conn.send(self.rank, step, self.region, digest, gen=0):
            raise RuntimeError(f"the store already held rank {self.rank} step {step}")
        return time.perf_counter() - t0

    def fetch(self, address: tuple[str, int], rank: int, step: int) -> float:
        """Fetch ``rank``'s shard of ``step`` from the store at ``address``; seconds."""
        from memckpt.runtime.wire.data_plane import StoreConnection
        conn = StoreConnection(_as_address(address))
        try:
            t0 = time.perf_counter()
            got = conn.fetch(rank, step, lambda n: self.landing[:n])
            elapsed = time.perf_counter() - t0
        finally:
            conn.close()
        if len(got) != len(self.region):
            raise RuntimeError(f"fetched {len(got)} bytes, expected {len(self.region)}")
        return elapsed
