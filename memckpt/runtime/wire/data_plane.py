"""The shard data plane's wire: a worker streams a sealed shard straight into a peer store's
file, and pulls one back for a restore. This module holds the protocol both ends speak and
the worker's end (:class:`StoreConnection`); the store's end is
:class:`memckpt.runtime.node.shard_server.ShardServer`.

Ray's object transfer between nodes copies a shard several times on its way
(into the sender's object store, across, out of the receiver's object store,
into the store's file) and each copy takes CPU the training step needs. Here a
worker keeps one TCP connection per replica holder and ``sendall``s the shard
from its snapshot slot; the store ``recv_into``s it directly into the replica's
shared-memory file, verifies the checksum and acknowledges. Control (which
store, which generation) stays on Ray; only the bytes take this path.

Before the bytes flow, the store fills the data chunks its own node already holds
at that step (the same checksum in a shard of another rank: DDP's parameters are
identical on every rank) with a local copy, and the sender skips them: only what
the holder lacks crosses the network (see :meth:`memckpt.runtime.node.replica_store.ReplicaStore.fill_local`).

A restore after a node failure pulls a shard the same way in the other direction
(``fetch``): the store ``sendall``s its file, the worker receives it into one
buffer and verifies it before loading.

Protocol, per shard, on a connection that carries many requests in turn::

    put:   client -> {"rank", "step", "nbytes", "checksum", "gen",   (length-prefixed JSON)
                      "chunks": {"data_offset", "chunk_bytes", "digests"}}
           server -> {"ok": true, "send": bool, "filled": [chunk index, ...]}
                   | {"ok": false, "error", "message"}
           client -> the nbytes raw bytes but the filled chunks          (only if "send")
           server -> {"ok": true, "checksum"} | {"ok": false, "error", "message"}
    fetch: client -> {"op": "fetch", "rank", "step"}
           server -> {"ok": true, "nbytes"} + nbytes raw bytes | {"ok": false, ...}
    range: client -> {"op": "fetch", "rank", "step", "offset", "length"}
           server -> {"ok": true, "nbytes"} + those bytes of the held shard (fewer where
                     it ends) | {"ok": false, ...}; a resharded restore reads this way
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any, Callable, Iterator, Optional

import numpy as np

from memckpt.format import shard as fmt
from memckpt.errors import (ChecksumError, MemckptError, NoSnapshotError, PlacementError,
                            StaleGenerationError, SupersededPutError)

_LEN = struct.Struct("<I")
RECV_CHUNK = 16 << 20  # the receiver re-checks its generation fence between chunks
SOCKET_BUFFER = 4 << 20
MAX_HEADER = 1 << 20

# Errors a store may answer with, re-raised as the same type on the sender.
_ERRORS: dict[str, type[MemckptError]] = {
    cls.__name__: cls for cls in (MemckptError, ChecksumError, NoSnapshotError, PlacementError,
                                  StaleGenerationError, SupersededPutError)}


# -- framing ------------------------------------------------------------------------------------
def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf))
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first."""
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection mid-message")
        got += n


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> dict[str, Any]:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"message of {n} bytes is not a memckpt shard header")
    return json.loads(_recv_exact(sock, n))


def tune(sock: socket.socket) -> None:
    """The socket options both ends set: no Nagle delay, large buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)


def pieces(offset: int, nbytes: int) -> Iterator[tuple[int, int]]:
    """``offset .. offset+nbytes`` in RECV_CHUNK pieces (the receiver re-checks its
    generation fence between pieces; the sender checks for cancellation)."""
    for off in range(offset, offset + nbytes, RECV_CHUNK):
        yield off, min(RECV_CHUNK, offset + nbytes - off)


def spans(nbytes: int, chunks: Optional[fmt.Chunks], filled: list[int]) -> list[tuple[int, int]]:
    """(offset, length) of the parts of a shard's ``nbytes`` bytes that cross the wire:
    everything but the ``filled`` chunks, adjacent parts merged."""
    if chunks is None or not filled:
        return [(0, nbytes)]
    out: list[tuple[int, int]] = []
    pos = 0
    for index in sorted(set(filled)):
        if not 0 <= index < len(chunks.digests):
            continue
        start, length = chunks.span(index, nbytes - chunks.data_offset)
        if start > pos:
            out.append((pos, start - pos))
        pos = max(pos, start + length)
    if pos < nbytes:
        out.append((pos, nbytes - pos))
    return out


def _chunks_msg(chunks: Optional[fmt.Chunks]) -> Optional[dict[str, Any]]:
    return None if chunks is None else {"data_offset": chunks.data_offset,
                                        "chunk_bytes": chunks.chunk_bytes,
                                        "digests": list(chunks.digests)}


def chunks_of(msg: Any, nbytes: int) -> Optional[fmt.Chunks]:
    """The chunk table of a put request, if it sent a usable one."""
    try:
        chunks = fmt.Chunks(int(msg["data_offset"]), int(msg["chunk_bytes"]),
                            tuple(str(d) for d in msg["digests"]))
    except (TypeError, KeyError, ValueError):
        return None
    data_len = nbytes - chunks.data_offset
    if (chunks.chunk_bytes <= 0 or not 0 <= chunks.data_offset <= nbytes
            or len(chunks.digests) != -(-data_len // chunks.chunk_bytes)):
        return None
    return chunks


def refusal(e: MemckptError) -> dict[str, Any]:
    """A store's answer that refuses a request with ``e`` (raised again on the sender)."""
    return {"ok": False, "error": type(e).__name__, "message": str(e)}


def _raise_from(reply: dict[str, Any]) -> None:
    if not reply.get("ok"):
        raise _ERRORS.get(reply.get("error", ""), MemckptError)(reply.get("message", "store error"))


# -- client (inside a worker) -------------------------------------------------------------------
class StoreConnection:
    """One connection to one store: ``send`` streams a shard in and waits for the verified
    ack; ``fetch`` pulls a held shard out."""

    def __init__(self, address: tuple[str, int], timeout_s: float = 120.0) -> None:
        self.address = (str(address[0]), int(address[1]))
        self._sock = socket.create_connection(self.address, timeout=timeout_s)
        tune(self._sock)

    def send(self, rank: int, step: int, raw: np.ndarray, checksum: str, gen: int,
             cancelled: Callable[[], bool] = lambda: False,
             chunks: Optional[fmt.Chunks] = None) -> int:
        """Stream ``raw``, but for the data chunks (``chunks``: the shard's chunk table) the
        store fills from what its node holds. Returns the bytes sent: 0 if the store
        already held this exact shard. Raises the store's error (checksum mismatch, stale
        generation, no RAM) or OSError."""
        send_msg(self._sock, {"rank": rank, "step": step, "nbytes": len(raw),
                              "checksum": checksum, "gen": gen, "chunks": _chunks_msg(chunks)})
        go = recv_msg(self._sock)
        _raise_from(go)
        if not go["send"]:
            return 0
        view = memoryview(raw).cast("B")
        sent = 0
        for span in spans(len(view), chunks, [int(i) for i in go.get("filled", ())]):
            for off, n in pieces(*span):
                if cancelled():
                    self.close()  # the store drops the half-received slot
                    raise ConnectionError("replication cancelled")
                self._sock.sendall(view[off: off + n])
                sent += n
        _raise_from(recv_msg(self._sock))
        return sent

    def fetch(self, rank: int, step: int,
              into: Optional[Callable[[int], np.ndarray]] = None) -> np.ndarray:
        """``rank``'s shard of ``step`` as the store holds it, received into ``into(nbytes)``
        (a fresh buffer, or a snapshot slot) with its prefix flagged incomplete: pass it to
        :func:`memckpt.format.shard.accept_received` to verify it before use. Raises the store's
        error (:class:`NoSnapshotError` if it holds none) or OSError."""
        send_msg(self._sock, {"op": "fetch", "rank": rank, "step": step})
        head = recv_msg(self._sock)
        _raise_from(head)
        nbytes = int(head["nbytes"])
        out = into(nbytes) if into is not None else np.empty(nbytes, dtype=np.uint8)
        fmt.fill_flagged(out, 0, nbytes, lambda view: recv_into(self._sock, view))
        return out[:nbytes]

    def fetch_range(self, rank: int, step: int, offset: int, length: int) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of ``rank``'s held shard of ``step`` (fewer
        where it ends), unverified: the caller checks them against the shard's chunk
        checksums. Raises the store's error or OSError."""
        send_msg(self._sock, {"op": "fetch", "rank": rank, "step": step, "offset": offset,
                              "length": length})
        head = recv_msg(self._sock)
        _raise_from(head)
        out = np.empty(int(head["nbytes"]), dtype=np.uint8)
        recv_into(self._sock, memoryview(out))
        return out

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
