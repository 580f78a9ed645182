"""The coordinator in a process of its own, called as an actor is: the stand-in for Ray's
actor RPC in ``memckpt bench control-plane``.

:func:`start` spawns a process that hosts the real
:class:`~memckpt.runtime.coordinator.coordinator.Coordinator` on an asyncio loop, as Ray
runs an async actor, and returns a :class:`Link` to it over an OS pipe (a socket pair).
Each call is its arguments pickled in the caller's thread (as ``.remote()`` serializes
them), sent in order (Ray keeps one caller's calls in order; the pipe keeps all of them),
unpickled and run as a task on the coordinator's loop (an ``async`` method may park:
``node_ready`` holds until the commit), its reply pickled back. ``link.handle`` is what
:class:`~memckpt.runtime.node.uplink.Uplink` takes as the coordinator's handle
(``handle.method.remote(*args) -> ref``, never blocking) and ``link.get`` is its ``get``
(``(ref, timeout) -> answer``, :class:`TimeoutError` when none came in time).

The coordinator's process counts what it takes and where its CPU goes (``link.stats()``):
the calls and their argument bytes by method, the CPU inside the coordinator's methods
(each step of each call's coroutine timed on the loop's thread), the (de)serialization,
and the whole process's CPU (its loop, which also reads and writes the pipe: what Ray's
core worker and gRPC threads do in an actor's process).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import pickle
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Generator, Optional

PROTOCOL = 5  # Ray's pickle protocol
# a call's frame: "<id> <method>\n" + its pickled arguments; a reply's: _REPLY (its call's id,
# when the call was read off the pipe, when it was answered) + the pickled answer
_REPLY = struct.Struct("<Qdd")
_ERROR = "__memckpt_bench_error__"


def thread_cpu(thread: threading.Thread) -> float:
    """``thread``'s CPU seconds so far (0.0 once it ended)."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident or 0))
    except (OSError, ProcessLookupError):
        return 0.0


# -- the coordinator's process ------------------------------------------------------------------
class _Timed:
    """Awaits ``coro`` and adds the CPU of each of its steps on this thread to ``spent``
    (the time it is parked in a wait is not counted)."""

    __slots__ = ("coro", "spent", "method")

    def __init__(self, coro: Any, spent: defaultdict[str, float], method: str) -> None:
        self.coro, self.spent, self.method = coro, spent, method

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, send, exc = self.coro, None, None
        clock = time.thread_time
        while True:
            t0 = clock()
            try:
                out = coro.throw(exc) if exc is not None else coro.send(send)
            except StopIteration as stop:
                self.spent[self.method] += clock() - t0
                return stop.value
            except BaseException:
                self.spent[self.method] += clock() - t0
                raise
            self.spent[self.method] += clock() - t0
            send, exc = None, None
            try:
                send = yield out
            except BaseException as e:  # noqa: BLE001 - a cancellation, passed on to coro
                exc = e


class _Server:
    """The coordinator's actor process, one thread: its loop reads the calls off the pipe
    as they come (``add_reader``), runs each as a task and writes its reply."""

    def __init__(self, conn: Connection, world_size: int, run_dir: str) -> None:
        from memckpt.runtime.coordinator.coordinator import Coordinator, MemoryStateStore
        self.conn = conn
        self.state = MemoryStateStore()
        self.coordinator = Coordinator("bench", run_dir, world_size, state=self.state,
                                       inventory=lambda names, t: {})
        self.calls: Counter = Counter()  # calls by method
        self.bytes_in: Counter = Counter()  # their pickled arguments' bytes
        self.bytes_out = 0  # the replies' pickled bytes
        self.inside: defaultdict[str, float] = defaultdict(float)  # CPU s in its methods
        self.serial_s = 0.0  # CPU seconds unpickling arguments and pickling replies
        self.errors: Counter = Counter()  # calls that raised, by method
        self.last_error = ""
        self.tasks: set[asyncio.Task] = set()

    async def main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.loop.add_reader(self.conn.fileno(), self._read)
        self._send(0, 0.0, pickle.dumps("ready", PROTOCOL))
        await self.done
        self.loop.remove_reader(self.conn.fileno())

    def _read(self) -> None:
        """Every call waiting in the pipe (a frame is written whole: none is cut short)."""
        try:
            while self.conn.poll(0):
                self._dispatch(self.conn.recv_bytes())
        except (EOFError, OSError):
            self._finish()

    def _send(self, cid: int, t_in: float, reply: bytes) -> None:
        try:
            self.conn.send_bytes(_REPLY.pack(cid, t_in, time.monotonic()) + reply)
        except OSError:
            self._finish()

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def _dispatch(self, data: bytes) -> None:
        head = data.index(b"\n")
        cid_text, method = data[:head].decode().split(" ")
        cid, payload = int(cid_text), memoryview(data)[head + 1:]
        t_in = time.monotonic()
        if method.startswith("_"):
            self._control(cid, t_in, method)
            return
        t0 = time.thread_time()
        args = pickle.loads(payload)
        self.serial_s += time.thread_time() - t0
        self.calls[method] += 1
        self.bytes_in[method] += len(payload)
        task = self.loop.create_task(self._run(cid, t_in, method, args))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, cid: int, t_in: float, method: str, args: tuple) -> None:
        try:
            out = getattr(self.coordinator, method)(*args)
            if inspect.isawaitable(out):
                out = await _Timed(out, self.inside, method)
        except Exception as e:  # noqa: BLE001 - answered to the caller, as Ray would
            out = (_ERROR, f"{type(e).__name__}: {e}")
            self.errors[method] += 1
            self.last_error = f"{method}: {out[1]}"
        t0 = time.thread_time()
        reply = pickle.dumps(out, PROTOCOL)
        self.serial_s += time.thread_time() - t0
        self.bytes_out += len(reply)
        self._send(cid, t_in, reply)

    def _control(self, cid: int, t_in: float, method: str) -> None:
        if method == "_stats":
            reply: Any = self.stats()
        elif method == "_stop":
            reply = None
            self.loop.call_soon(self._finish)
        else:
            reply = (_ERROR, f"unknown control message {method}")
        self._send(cid, t_in, pickle.dumps(reply, PROTOCOL))

    def stats(self) -> dict[str, Any]:
        times = os.times()
        return {"process_cpu_s": time.process_time(), "loop_cpu_s": time.thread_time(),
                "user_s": times.user, "system_s": times.system,
                "calls": dict(self.calls), "bytes_in": dict(self.bytes_in),
                "bytes_out": self.bytes_out, "inside_s": dict(self.inside),
                "serial_s": self.serial_s, "errors": dict(self.errors),
                "last_error": self.last_error, "state_puts": self.state.puts,
                "state_bytes": self.state.bytes_written, "wall_s": time.monotonic()}


def _serve(conn: Any, world_size: int, run_dir: str) -> None:
    """The coordinator process's body (spawned)."""
    asyncio.run(_Server(conn, world_size, run_dir).main())


# -- the callers' side --------------------------------------------------------------------------
class Ref:
    """A call's reference: its answer once ``done`` is set; when it was sent, read by the
    coordinator's process, answered there, and its answer read here (``time.monotonic``,
    one clock for both processes)."""

    __slots__ = ("done", "value", "error", "method", "sent_at", "taken_at", "answered_at",
                 "got_at")

    def __init__(self, method: str) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: Optional[str] = None
        self.method = method
        self.sent_at = self.taken_at = self.answered_at = self.got_at = 0.0


# a node's store's calls, each a sign of life (a batch stands in for a heartbeat)
NODE_CALLS = ("node_ready", "node_metrics", "node_heartbeat", "group_ready")


class _Method:
    __slots__ = ("link", "name")

    def __init__(self, link: "Link", name: str) -> None:
        self.link, self.name = link, name

    def remote(self, *args: Any) -> Ref:
        """Pickle the arguments here (as ``.remote()`` does), queue the call, return."""
        key = args[0] if self.name in NODE_CALLS and args else None
        return self.link.call(self.name, pickle.dumps(args, PROTOCOL), key)


class Handle:
    """The coordinator's actor handle, as far as its callers use it."""

    def __init__(self, link: "Link") -> None:
        self._link = link
        self._methods: dict[str, _Method] = {}

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        m = self._methods.get(name)
        if m is None:
            m = self._methods[name] = _Method(self._link, name)
        return m


class Link:
    """The callers' end of the pipe to the coordinator's process (thread-safe)."""

    def __init__(self, conn: Any, process: Any) -> None:
        self.conn, self.process = conn, process
        self.handle = Handle(self)
        self._lock = threading.Lock()
        self._next = 1
        self._pending: dict[int, Ref] = {}
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self.log: list[Ref] = []  # the step batches (node_ready, group_ready), in the order sent
        self.last_sent: dict[Any, float] = {}  # node -> when it last said anything
        self._ready = Ref("_ready")
        self._pending[0] = self._ready
        self.reader = threading.Thread(target=self._read, daemon=True, name="bench-cp-link-in")
        self.writer = threading.Thread(target=self._write, daemon=True, name="bench-cp-link-out")
        self.reader.start()
        self.writer.start()

    def call(self, method: str, payload: bytes, key: Any = None) -> Ref:
        ref = Ref(method)
        with self._lock:
            cid, self._next = self._next, self._next + 1
            self._pending[cid] = ref
            ref.sent_at = time.monotonic()
            if method in ("node_ready", "group_ready"):
                self.log.append(ref)
            if key is not None:
                self.last_sent[key] = ref.sent_at
            self._out.put(f"{cid} {method}\n".encode() + payload)
        return ref

    def get(self, ref: Ref, timeout_s: float) -> Any:
        """``ref``'s answer; :class:`TimeoutError` if none within ``timeout_s``."""
        if not ref.done.wait(timeout_s):
            raise TimeoutError(f"{ref.method}: no answer within {timeout_s:g} s")
        if ref.error is not None:
            raise RuntimeError(f"coordinator.{ref.method}: {ref.error}")
        return ref.value

    def _write(self) -> None:
        while True:
            item = self._out.get()
            if item is None:
                return
            try:
                self.conn.send_bytes(item)
            except OSError:
                return

    def _read(self) -> None:
        while True:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError):
                break
            cid, taken, answered = _REPLY.unpack_from(data)
            value = pickle.loads(memoryview(data)[_REPLY.size:])
            with self._lock:
                ref = self._pending.pop(cid, None)
            if ref is None:
                continue
            if isinstance(value, tuple) and len(value) == 2 and value[0] == _ERROR:
                ref.error = value[1]
            else:
                ref.value = value
            ref.taken_at, ref.answered_at, ref.got_at = taken, answered, time.monotonic()
            ref.done.set()
        with self._lock:  # the process is gone: nothing more will be answered
            pending, self._pending = self._pending, {}
        for ref in pending.values():
            ref.error = "the coordinator's process exited"
            ref.done.set()

    def control(self, what: str, timeout_s: float = 60.0) -> Any:
        return self.get(self.call(what, b""), timeout_s)

    def stats(self) -> dict[str, Any]:
        """What the coordinator's process took and spent so far (see :class:`_Server`)."""
        return self.control("_stats")

    def close(self, timeout_s: float = 10.0) -> None:
        try:
            self.control("_stop", timeout_s)
        except (TimeoutError, RuntimeError):
            pass
        self._out.put(None)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout_s)
        self.conn.close()


def start(world_size: int, run_dir: str, timeout_s: float = 120.0) -> Link:
    """The coordinator of a ``world_size``-rank job in a process of its own (a fresh
    interpreter: nothing of this one is inherited or re-imported), its state in memory, its
    files under ``run_dir``; returns once it is serving."""
    import memckpt
    root = str(Path(memckpt.__file__).resolve().parents[1])  # this memckpt, whatever the cwd
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p))
    ours, theirs = socket.socketpair()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", __name__, str(theirs.fileno()), str(world_size), run_dir],
            pass_fds=(theirs.fileno(),), env=env)
    finally:
        theirs.close()
    link = Link(Connection(ours.detach()), process)
    try:
        link.get(link._ready, timeout_s)
    except BaseException:
        link.close(1.0)
        raise
    return link


if __name__ == "__main__":  # the coordinator's process (see start)
    _serve(Connection(int(sys.argv[1])), int(sys.argv[2]), sys.argv[3])
