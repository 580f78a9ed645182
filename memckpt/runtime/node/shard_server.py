"""The store's end of the shard data plane: a TCP server inside each replica store that
receives a worker's shard straight into the replica's shared-memory file (after filling what
its node already holds), verifies it before acknowledging, and serves held shards back for a
restore. The protocol and the worker's end are :mod:`memckpt.runtime.wire.data_plane`."""

from __future__ import annotations

import socket
import threading
from typing import Callable, Optional, Protocol, Union

import numpy as np

from memckpt.format import shard as fmt
from memckpt.errors import MemckptError
from memckpt.runtime.wire.data_plane import (GoAhead, PutRequest, Received, Refusal, Request,
                                             Sending, chunks_of, pieces, recv_into, send_shard_bytes,
                                             recv_request, refusal, send_msg, spans, tune)


class Receiver(Protocol):
    """What the server needs from a store (see :class:`memckpt.runtime.node.replica_store.ReplicaStore`)."""

    def begin(self, rank: int, step: int, nbytes: int, checksum: str, gen: int = -1) -> int: ...

    def receive(self, ticket: int, offset: int, nbytes: int,
                fill: Callable[[memoryview], None]) -> int: ...

    def fill_local(self, ticket: int, chunks: fmt.Chunks) -> list[int]: ...

    def finish(self, ticket: int) -> str: ...

    def serve_bytes(self, rank: int, step: int) -> np.ndarray: ...


# -- server (inside a store) --------------------------------------------------------------------
class ShardServer:
    """Accepts shard streams for ``store`` on ``host``; one thread per connection."""

    def __init__(self, store: Receiver, host: str) -> None:
        self.store = store
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._closed = False
        threading.Thread(target=self._accept, name="memckpt-shard-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            tune(conn)
            threading.Thread(target=self._serve, args=(conn,), name="memckpt-shard-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            while True:
                try:
                    req = recv_request(conn)
                except (ConnectionError, OSError, ValueError):
                    return  # the sender went away (or a stale generation's connection closed)
                try:
                    self._one(conn, req)
                except (ConnectionError, OSError):
                    return  # mid-shard: the slot stays incomplete, nobody trusts it

    def _one(self, conn: socket.socket, req: Request) -> None:
        if "op" in req:  # a FetchRequest (a put names no op)
            return self._send(conn, int(req["rank"]), int(req["step"]), req.get("offset"),
                              req.get("length"))
        return self._put(conn, req)

    def _send(self, conn: socket.socket, rank: int, step: int, offset: Optional[int] = None,
              length: Optional[int] = None) -> None:
        """Serve a held shard's bytes, or a range of them (unverified here: the fetching
        worker verifies)."""
        try:
            raw = self.store.serve_bytes(rank, step)
        except MemckptError as e:
            return send_msg(conn, refusal(e))
        start, nbytes = 0, len(raw)
        if offset is not None:
            start = min(len(raw), max(0, int(offset)))
            nbytes = min(len(raw) - start, max(0, int(length or 0)))
        head: Sending = {"ok": True, "nbytes": nbytes}
        send_msg(conn, head)
        send_shard_bytes(conn, raw, start, nbytes)

    def _put(self, conn: socket.socket, req: PutRequest) -> None:
        """Receive one shard: go-ahead (or refusal), bytes, verified acknowledgement."""
        rank, step, nbytes, gen = int(req["rank"]), int(req["step"]), int(req["nbytes"]), int(req["gen"])
        try:
            ticket = self.store.begin(rank, step, nbytes, req["checksum"], gen)
        except MemckptError as e:
            return send_msg(conn, refusal(e))
        chunks = chunks_of(req.get("chunks"), nbytes)
        filled = self.store.fill_local(ticket, chunks) if ticket and chunks else []
        go: GoAhead = {"ok": True, "send": bool(ticket), "filled": filled}
        send_msg(conn, go)
        if ticket:
            send_msg(conn, self._receive(conn, ticket, spans(nbytes, chunks, filled)))

    def _receive(self, conn: socket.socket, ticket: int,
                 spans: list[tuple[int, int]]) -> Union[Received, Refusal]:
        error: Optional[MemckptError] = None
        for off, n in (piece for span in spans for piece in pieces(*span)):
            if error is not None:  # keep the stream in step: read and drop the rest
                recv_into(conn, memoryview(bytearray(n)))
                continue
            try:
                self.store.receive(ticket, off, n, lambda view: recv_into(conn, view))
            except MemckptError as e:  # refused before reading: drop this piece, then the rest
                error = e
                recv_into(conn, memoryview(bytearray(n)))
        if error is None:
            try:
                return {"ok": True, "checksum": self.store.finish(ticket)}
            except MemckptError as e:
                error = e
        return refusal(error)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass
