"""A generation's rendezvous: rank 0's worker listens on its port from the moment it names it,
so no other process can take the port before the ranks meet (real sockets, no Ray)."""

from __future__ import annotations

import datetime
import errno
import socket

import pytest

from memckpt.runtime.worker import rendezvous

T = datetime.timedelta(seconds=20)


def test_the_port_named_is_listened_on_and_cannot_be_taken():
    held = rendezvous.host("127.0.0.1", T)
    with socket.create_connection(("127.0.0.1", held.port), timeout=5):
        pass  # listening already: a rank can connect before rank 0 runs anything else
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        other.bind(("", held.port))  # a process probing for a free port now: refused
    assert taken.value.errno == errno.EADDRINUSE


def test_ranks_meet_in_the_store_rank_0_holds():
    held = rendezvous.host("127.0.0.1", T)
    master = ("127.0.0.1", held.port)
    zero = rendezvous.join(master, 0, held, T)
    assert zero is held
    one = rendezvous.join(master, 1, None, T)
    zero.set("from-0", b"a")
    one.set("from-1", b"b")
    assert one.get("from-0") == b"a" and zero.get("from-1") == b"b"


@pytest.mark.parametrize("held", ["none", "another"])
def test_a_rank_0_without_this_rendezvous_hosts_the_given_port(held):
    """A caller that chose the port itself (the old way), or a worker still holding another
    rendezvous's store: rank 0 hosts the port it was given, and the ranks meet there."""
    other = rendezvous.host("127.0.0.1", T) if held == "another" else None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    zero = rendezvous.join(("127.0.0.1", port), 0, other, T)
    assert zero is not other
    rendezvous.join(("127.0.0.1", port), 1, None, T).set("k", b"v")
    assert zero.get("k") == b"v"
