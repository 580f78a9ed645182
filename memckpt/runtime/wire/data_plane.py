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

Protocol, per shard, on a connection that carries many requests in turn (each message's
shape is a ``TypedDict`` below, one definition for both ends: :class:`PutRequest`,
:class:`FetchRequest`; :class:`GoAhead`, :class:`Received`, :class:`Sending`,
:class:`Refusal`)::

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
from typing import Callable, Iterator, Literal, Mapping, Optional, TypedDict, Union, cast, final

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


# -- the messages (length-prefixed JSON objects; keys in the order written here) ---------------
class ChunkTable(TypedDict):
    """A put's chunk table: where the data chunks start, their size, their digests."""

    data_offset: int
    chunk_bytes: int
    digests: list[str]


@final  # final: a request naming "op" is a FetchRequest (mypy narrows on it)
class PutRequest(TypedDict):
    """Client -> server: a shard of ``nbytes`` follows if the server says "send"."""

    rank: int
    step: int
    nbytes: int
    checksum: str
    gen: int
    chunks: Optional[ChunkTable]


class _FetchWhat(TypedDict):
    op: Literal["fetch"]
    rank: int
    step: int


@final
class FetchRequest(_FetchWhat, total=False):
    """Client -> server: a held shard, or (``offset``, ``length``) a range of it."""

    offset: int
    length: int


Request = Union[PutRequest, FetchRequest]


class GoAhead(TypedDict):
    """Server -> client, to a put: send the bytes (or not: it holds the shard), all but the
    ``filled`` chunks (filled from its own node)."""

    ok: Literal[True]
    send: bool
    filled: list[int]


class Received(TypedDict):
    """Server -> client, after a put's bytes: verified, with this checksum."""

    ok: Literal[True]
    checksum: str


class Sending(TypedDict):
    """Server -> client, to a fetch: ``nbytes`` raw bytes follow."""

    ok: Literal[True]
    nbytes: int


class Refusal(TypedDict):
    """Server -> client, to any request: refused with ``error`` (an error type's name)."""

    ok: Literal[False]
    error: str
    message: str


Reply = Union[GoAhead, Received, Sending, Refusal]
Message = Union[PutRequest, FetchRequest, GoAhead, Received, Sending, Refusal]


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


def send_msg(sock: socket.socket, msg: Message) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_json(sock: socket.socket) -> object:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_HEADER:
        raise ConnectionError(f"message of {n} bytes is not a memckpt shard header")
    return json.loads(_recv_exact(sock, n))


def recv_request(sock: socket.socket) -> Request:
    """The next request (the server's end). ValueError: not a JSON object."""
    msg = _recv_json(sock)
    if not isinstance(msg, dict):
        raise ValueError(f"a data-plane request is a JSON object, not {type(msg).__name__}")
    return cast(Request, msg)


def _accepted(sock: socket.socket) -> Mapping[str, object]:
    """The next reply (the client's end), raised again as its error if it is a refusal."""
    reply = _recv_json(sock)
    if not isinstance(reply, dict):
        raise MemckptError(f"the store answered {type(reply).__name__}, not a JSON object")
    if not reply.get("ok"):
        raise _ERRORS.get(str(reply.get("error", "")), MemckptError)(
            str(reply.get("message", "store error")))
    return reply


def recv_go_ahead(sock: socket.socket) -> GoAhead:
    return cast(GoAhead, _accepted(sock))


def recv_received(sock: socket.socket) -> Received:
    return cast(Received, _accepted(sock))


def recv_sending(sock: socket.socket) -> Sending:
    return cast(Sending, _accepted(sock))


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


def send_shard_bytes(sock: socket.socket, raw: np.ndarray, offset: int, nbytes: int,
                     zeros: Optional[list[tuple[int, int]]] = None) -> None:
    """``sendall`` bytes ``offset .. offset+nbytes`` of the shard ``raw``, the pages that
    hold none of its bytes (``zeros``: :func:`memckpt.format.shard.zero_runs`) sent as the
    zeros they are instead of read from ``raw``: a slot leaves them unallocated, and reading
    them through its mapping would allocate them."""
    view = memoryview(raw).cast("B")
    end, at = offset + nbytes, offset
    for start, length in (fmt.zero_runs(raw) if zeros is None else zeros) + [(end, 0)]:
        start, stop = max(start, at), min(start + length, end)
        if start >= end:
            break
        if start > at:
            sock.sendall(view[at: start])
        while start < stop:
            n = min(stop - start, len(_ZEROS))
            sock.sendall(_ZEROS[:n])
            start += n
        at = max(at, stop)
    if at < end:
        sock.sendall(view[at: end])


_ZEROS = memoryview(bytes(1 << 20))


def _chunks_msg(chunks: Optional[fmt.Chunks]) -> Optional[ChunkTable]:
    return None if chunks is None else ChunkTable(data_offset=chunks.data_offset,
                                                  chunk_bytes=chunks.chunk_bytes,
                                                  digests=list(chunks.digests))


def chunks_of(msg: Optional[ChunkTable], nbytes: int) -> Optional[fmt.Chunks]:
    """The chunk table of a put request, if it sent a usable one (it is the sender's JSON:
    checked here, not trusted)."""
    if msg is None:
        return None
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


def refusal(e: MemckptError) -> Refusal:
    """A store's answer that refuses a request with ``e`` (raised again on the sender)."""
    return {"ok": False, "error": type(e).__name__, "message": str(e)}


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
             chunks: Optional[fmt.Chunks] = None,
             stop_at: Optional[tuple[int, Callable[[], None]]] = None) -> int:
        """Stream ``raw``, but for the data chunks (``chunks``: the shard's chunk table) the
        store fills from what its node holds. Returns the bytes sent: 0 if the store
        already held this exact shard. Raises the store's error (checksum mismatch, stale
        generation, no RAM) or OSError. ``stop_at`` (a drill's fault: the byte, what
        fires it): called once that many bytes crossed (or all of them, before the store's
        answer, when fewer cross), the rest sent if it returns."""
        put: PutRequest = {"rank": rank, "step": step, "nbytes": len(raw), "checksum": checksum,
                           "gen": gen, "chunks": _chunks_msg(chunks)}
        send_msg(self._sock, put)
        go = recv_go_ahead(self._sock)
        if not go["send"]:
            return 0
        sent, zeros = 0, fmt.zero_runs(raw)
        for span in spans(len(raw), chunks, [int(i) for i in go.get("filled", ())]):
            for off, n in pieces(*span):
                if cancelled():
                    self.close()  # the store drops the half-received slot
                    raise ConnectionError("replication cancelled")
                if stop_at is not None and sent + n > stop_at[0]:
                    first = max(0, stop_at[0] - sent)
                    send_shard_bytes(self._sock, raw, off, first, zeros)
                    stop_at[1]()  # the fault: this process (or its node) dies here
                    stop_at, off, n, sent = None, off + first, n - first, sent + first
                send_shard_bytes(self._sock, raw, off, n, zeros)
                sent += n
        if stop_at is not None:  # aimed past the end: once the last byte crossed
            stop_at[1]()
        recv_received(self._sock)
        return sent

    def fetch(self, rank: int, step: int,
              into: Optional[Callable[[int], np.ndarray]] = None) -> np.ndarray:
        """``rank``'s shard of ``step`` as the store holds it, received into ``into(nbytes)``
        (a fresh buffer, or a snapshot slot) with its prefix flagged incomplete: pass it to
        :func:`memckpt.format.shard.accept_received` to verify it before use. Raises the store's
        error (:class:`NoSnapshotError` if it holds none) or OSError."""
        send_msg(self._sock, FetchRequest(op="fetch", rank=rank, step=step))
        nbytes = int(recv_sending(self._sock)["nbytes"])
        out = into(nbytes) if into is not None else np.empty(nbytes, dtype=np.uint8)
        fmt.fill_flagged(out, 0, nbytes, lambda view: recv_into(self._sock, view))
        return out[:nbytes]

    def fetch_range(self, rank: int, step: int, offset: int, length: int) -> np.ndarray:
        """Bytes ``[offset, offset + length)`` of ``rank``'s held shard of ``step`` (fewer
        where it ends), unverified: the caller checks them against the shard's chunk
        checksums. Raises the store's error or OSError."""
        send_msg(self._sock, FetchRequest(op="fetch", rank=rank, step=step, offset=offset,
                                          length=length))
        out = np.empty(int(recv_sending(self._sock)["nbytes"]), dtype=np.uint8)
        recv_into(self._sock, memoryview(out))
        return out

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass
