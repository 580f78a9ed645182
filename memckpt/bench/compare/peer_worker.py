"""One training process of ``memckpt bench compare --peers`` (see :mod:`.peers`).

``python -m memckpt.bench.compare.peer_worker SPEC_JSON``: trains the same MLP with AdamW on the
same batches (a batch is a function of the seed, the step and the data rank) under one method:

  none      plain data parallel over gloo, no checkpoint (the harness's baseline)
  memckpt   the same, ``memckpt.Checkpointer`` snapshot every step (shared memory)
  dlrover   the same, DLRover's ``DdpCheckpointer`` ``save_checkpoint(StorageType.MEMORY)``
            every step, its saver started by local rank 0 (the mode without ``dlrover-run``)
  torchft   one replica group of one rank: torchft ``Manager`` + its DDP and optimizer
            wrappers over ``ProcessGroupGloo``, ``PGTransport`` for healing (train_ddp.py)

It writes one JSON line per event to ``spec["log"]`` (``restored``, ``step``, ``kill``, ``done``)
and, at the end, its parameters and optimizer state to ``spec["out"]`` (torch.save).
At ``spec["kill_step"]`` the rank ``spec["kill_rank"]`` SIGKILLs itself after its forward pass,
before its gradients are exchanged (``job_kill_step``: every process of the job).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

LAYERS = 4


def width_for(state_bytes: int) -> int:
    """The MLP width whose params + AdamW moments (3 x 4 bytes per param) fill ``state_bytes``."""
    return max(8, int((state_bytes / (12 * LAYERS)) ** 0.5))


def build(width: int, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(LAYERS):
        layers.append(torch.nn.Linear(width, width, bias=True))
        if i < LAYERS - 1:
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def batch(seed: int, step: int, data_rank: int, width: int, n: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1_009 + data_rank)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": opt.state_dict()}


class Log:
    def __init__(self, path: str, rank: int) -> None:
        self.f = open(path, "a", buffering=1)
        self.rank = rank

    def __call__(self, event: str, **fields: Any) -> None:
        self.f.write(json.dumps({"event": event, "rank": self.rank, "t": time.time(), **fields})
                     + "\n")
        self.f.flush()


def _anon(pid: Optional[int] = None) -> int:
    """A process's anonymous memory (heap; not its shared-memory or file pages, which are
    counted by their files): ``Anonymous`` of /proc/PID/smaps_rollup, else its USS."""
    try:
        for line in open(f"/proc/{pid or os.getpid()}/smaps_rollup"):
            if line.startswith("Anonymous:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import psutil
    return int(psutil.Process(pid).memory_full_info().uss)


def _children_anon() -> int:
    import psutil
    total = 0
    for c in psutil.Process().children(recursive=True):
        try:
            total += _anon(c.pid)
        except Exception:  # noqa: BLE001 (gone meanwhile)
            pass
    return total


def _pace(spec: dict[str, Any], since: float) -> None:
    """The simulated rest of a forward+backward: the step's compute lasts ``step_s``."""
    left = spec.get("step_s", 0.0) - (time.perf_counter() - since)
    if left > 0:
        time.sleep(left)


def _barrier(spec: dict[str, Any], rank: int, timeout_s: float = 300.0) -> None:
    """Wait until every rank of the job has reached this point (files in ``barrier_dir``)."""
    folder = spec["barrier_dir"]
    os.makedirs(folder, exist_ok=True)
    open(os.path.join(folder, f"ready-{rank}"), "w").close()
    deadline = time.time() + timeout_s
    while len([f for f in os.listdir(folder) if f.startswith("ready-")]) < spec["world"]:
        if time.time() > deadline:
            raise TimeoutError(f"not every rank started within {timeout_s:.0f} s")
        time.sleep(0.02)


def _end_children() -> None:
    """SIGKILL what this process started (DLRover's saver is a daemon child that a plain
    ``os._exit`` would leave behind)."""
    import psutil
    for c in psutil.Process().children(recursive=True):
        try:
            os.kill(c.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _maybe_kill(spec: dict[str, Any], rank: int, step: int, log: Log) -> None:
    """SIGKILL this rank (``kill_step``), or every process of the job (``job_kill_step``),
    once, in the first incarnation, after the forward pass of ``step`` (before the gradients
    are exchanged, so no peer has the step's contribution of this rank)."""
    if spec.get("kill_rank") != rank or spec.get("restarted"):
        return
    if spec.get("kill_step") == step:
        log("kill", step=step)
        os.kill(os.getpid(), signal.SIGKILL)
    if spec.get("job_kill_step") == step:
        log("job_kill", step=step)
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _allreduce_grads(model: torch.nn.Module, world: int) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


# -- the savers of the plain harness: restore() -> step, save(step) ---------------------------
class _NoSaver:
    def restore(self) -> int:
        return 0

    def save(self, step: int) -> None:
        pass

    def ram_bytes(self) -> int:
        return 0


class _MemckptSaver:
    def __init__(self, spec: dict[str, Any], model: torch.nn.Module,
                 opt: torch.optim.Optimizer, rank: int, world: int) -> None:
        from memckpt import Checkpointer, Config, TrainState
        self.state = TrainState(model=model, optimizer=opt, rng=False)
        self.sealed: dict[int, float] = {}
        self.ckpt = Checkpointer(Config(job_name=spec["job"], ram_root=spec["ram_dir"]),
                                 rank=rank, world_size=world,
                                 on_sealed=lambda step, _p: self.sealed.__setitem__(step,
                                                                                    time.time()))

    def restore(self) -> int:
        return self.ckpt.restore(self.state)

    def save(self, step: int) -> None:
        self.ckpt.step(self.state, step)

    def usable_at(self, step: int) -> Optional[float]:
        self.ckpt.wait()
        return self.sealed.get(step)

    def ram_bytes(self) -> int:
        from memckpt.engine.buffers import allocated_bytes
        return allocated_bytes(self.ckpt.directory)


class _DlroverSaver:
    def __init__(self, spec: dict[str, Any], model: torch.nn.Module,
                 opt: torch.optim.Optimizer, rank: int, world: int) -> None:
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType
        self.memory = StorageType.MEMORY
        self.model, self.opt = model, opt
        self.ckpt = DdpCheckpointer(spec["disk_dir"])
        self.skipped = 0

    def restore(self) -> int:
        sd = self.ckpt.load_checkpoint()
        if not sd:
            return 0
        # its tensors view DLRover's shared memory, and on CPU Optimizer.load_state_dict keeps
        # them as they are: the optimizer would then train in (and a later save write over,
        # or an unmap pull away: SIGSEGV) that buffer. Copy them, as a CPU user must.
        sd = _clone(sd)
        self.model.load_state_dict(sd["model"])
        self.opt.load_state_dict(sd["optim"])
        return int(sd["step"])

    def save(self, step: int) -> None:
        sd = {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": step}
        # save_checkpoint returns None; the engine's save_to_memory says whether it skipped
        if self.ckpt._engine.save_to_memory(step, {"model_states": sd},
                                            {"model_states": ""}) is False:
            self.skipped += 1

    def ram_bytes(self) -> int:
        shm = self.ckpt._engine._shm_handler.shared_memory
        name = getattr(shm, "_name", None) or (shm.name if shm is not None else None)
        if not name:
            return 0
        try:
            return os.stat("/dev/shm/" + name.lstrip("/")).st_blocks * 512
        except FileNotFoundError:
            return 0


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return x


SAVERS: dict[str, Callable[..., Any]] = {"memckpt": _MemckptSaver, "dlrover": _DlroverSaver}


def run_plain(spec: dict[str, Any], log: Log) -> dict[str, Any]:
    rank, world, seed, width = spec["rank"], spec["world"], spec["seed"], spec["width"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec['port']}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    model, opt = build(width, seed)
    saver = SAVERS[spec["method"]](spec, model, opt, rank, world) \
        if spec["method"] in SAVERS else _NoSaver()
    t0 = time.time()
    start = saver.restore()
    log("restored", step=start, restore_s=time.time() - t0)
    blocking, usable = [], []
    for step in range(start + 1, spec["steps"] + 1):
        x, y = batch(seed, step, rank, width, spec["batch"])
        opt.zero_grad()
        t_step = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        _pace(spec, t_step)
        _maybe_kill(spec, rank, step, log)
        loss.backward()
        _allreduce_grads(model, world)
        opt.step()
        t_call, p0 = time.time(), time.perf_counter()
        saver.save(step)
        block = time.perf_counter() - p0
        blocking.append(block)
        if spec.get("measure_usable") and hasattr(saver, "usable_at"):
            at = saver.usable_at(step)
            usable.append(None if at is None else at - t_call)
        elif spec["method"] == "dlrover":
            usable.append(block)  # the copy in shared memory is complete when the call returns
        log("step", step=step, participants=world, blocking_s=block)
    extra = {"ram_bytes": saver.ram_bytes(), "anon": _anon(), "children_anon": _children_anon(),
             "skipped": getattr(saver, "skipped", 0)}
    dist.barrier()
    return {"model": model, "opt": opt, "blocking": blocking, "usable": usable, **extra}


def _ft_allreduce(manager: Any, model: torch.nn.Module) -> None:
    """The gradients' average over the participating groups through ``Manager.allreduce``,
    which records a failed peer (``should_commit`` then says no) instead of raising. Not
    torchft's DDP wrapper: in 0.2.0 its comm hook fails (``assert fut._fut``) when the
    allreduce fails, and the survivor dies with the peer."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    manager.allreduce(flat).wait()
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()


def run_torchft(spec: dict[str, Any], log: Log) -> dict[str, Any]:
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport
    group, seed, width, s = spec["rank"], spec["seed"], spec["width"], spec["torchft"]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    model, inner = build(width, seed)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=s["pg_timeout_s"]))
    transport: Any = PGTransport(pg, timeout=timedelta(seconds=s["transport_timeout_s"]),
                                 device=torch.device("cpu"))
    manager = Manager(pg=pg, min_replica_size=1,
                      load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                                  inner.load_state_dict(sd["optim"])),
                      state_dict=lambda: state_of(model, inner),
                      replica_id=f"bench_{group}", timeout=timedelta(seconds=s["timeout_s"]),
                      checkpoint_transport=transport, store_addr="127.0.0.1",
                      store_port=store.port, rank=0, world_size=1,
                      lighthouse_addr=spec["lighthouse"], hostname="127.0.0.1",
                      heartbeat_interval=timedelta(milliseconds=s["heartbeat_ms"]))
    opt = Optimizer(manager, inner)
    if not spec.get("restarted"):  # every group in the first quorum: start together
        _barrier(spec, group)
    log("restored", step=manager.current_step(), restore_s=0.0)
    blocking: list[float] = []
    while manager.current_step() < spec["steps"]:
        opt.zero_grad()  # starts the quorum (asynchronously, as by default)
        step = manager.current_step() + 1  # a healing group's gradient is zeroed anyway
        x, y = batch(seed, step, group, width, spec["batch"])
        t_step = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        _pace(spec, t_step)
        _maybe_kill(spec, group, step, log)
        loss.backward()
        _ft_allreduce(manager, model)
        p0 = time.perf_counter()
        committed = manager.should_commit()  # what Optimizer.step does, timed apart
        block = time.perf_counter() - p0
        if committed:
            inner.step()
        blocking.append(block)
        log("step", step=manager.current_step(), committed=committed,
            participants=manager.num_participants(), blocking_s=block)
    return {"model": model, "opt": inner, "blocking": blocking, "usable": [], "ram_bytes": 0,
            "anon": _anon(), "children_anon": _children_anon(), "skipped": 0}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    torch.set_num_threads(1)
    log = Log(spec["log"], spec["rank"])
    res = run_torchft(spec, log) if spec["method"] == "torchft" else run_plain(spec, log)
    torch.save({"model": res["model"].state_dict(), "optim": res["opt"].state_dict()},
               spec["out"])
    log("done", blocking=res["blocking"], usable=res["usable"], ram_bytes=res["ram_bytes"],
        anon=res["anon"], children_anon=res["children_anon"], skipped=res["skipped"])
    # a torchft group may still be needed by another for its last steps: stay until the
    # bench says every rank is done (its stop file)
    deadline = time.time() + spec.get("linger_s", 0)
    while time.time() < deadline and not os.path.exists(spec["stop_file"]):
        time.sleep(0.05)
    sys.stdout.flush()
    _end_children()
    os._exit(0)  # no teardown races with a peer's saver or manager threads


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
