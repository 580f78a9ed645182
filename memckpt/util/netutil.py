"""Small network helpers."""

from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on ``host`` right now (all interfaces by default), for a listener
    about to be started: the OS picks it, so two callers never race for a fixed number."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
