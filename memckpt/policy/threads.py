"""How many threads a rank's seal and restore checks may use, as pure code.

xxhash releases the GIL, so the chunk digests of a snapshot scale with threads up to
the cores the process may run on. Ranks that share a node share its cores: each gets
an even part, so eight ranks on a 64-core node hash on 8 threads each, not 64.
"""

from __future__ import annotations

import os
from typing import Mapping, Optional

from memckpt.errors import ConfigError

MAX_AUTO_THREADS = 16  # beyond this a rank's seal is bound by memory bandwidth, not threads
LOCAL_RANKS_ENV = ("LOCAL_WORLD_SIZE", "MEMCKPT_LOCAL_RANKS")  # torchrun's, then memckpt's own


def hash_threads(setting: int, cores: int, local_ranks: int) -> int:
    """Threads for one rank: ``setting`` when > 0, else the rank's even part of ``cores``
    (at least 1, at most :data:`MAX_AUTO_THREADS`)."""
    if setting < 0 or cores < 1 or local_ranks < 1:
        raise ConfigError(f"hash_threads(setting={setting}, cores={cores}, local_ranks="
                          f"{local_ranks}): the setting must be >= 0 (0: automatic), cores "
                          "and ranks >= 1")
    if setting > 0:
        return setting
    return max(1, min(MAX_AUTO_THREADS, cores // local_ranks))


def local_ranks_from(env: Mapping[str, str], default: int = 1) -> int:
    """Ranks sharing this node, from the launcher's environment (``default`` if unset)."""
    for name in LOCAL_RANKS_ENV:
        value: Optional[str] = env.get(name)
        if value and value.isdigit() and int(value) >= 1:
            return int(value)
    return default


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
