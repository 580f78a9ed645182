"""Find a running job's coordinator from another process (``memckpt status`` and ``kill``)."""

from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Mapping, Optional, Union

from memckpt.errors import ConfigError, MemckptError

if TYPE_CHECKING:  # at run time imported with Ray, once a job is asked
    from memckpt.runtime.coordinator.messages import CoordinatorStatus

_FIX = ("start the job first, or pass --address HOST:PORT (or set RAY_ADDRESS) to the head of "
        "the cluster it runs on")
PROBE_TIMEOUT_S = 5.0


def probe(address: Optional[str]) -> None:
    """Fail fast, in one line naming ``--address`` / ``RAY_ADDRESS``, when no Ray cluster can
    answer where ``ray.init(address=address)`` would look: RAY_ADDRESS when set (Ray lets it
    win), else ``address``; "auto" is resolved as Ray resolves it. ray.init itself would retry
    a dead address for minutes, printing a warning every few seconds. ``None`` (start a local
    instance) and ``ray://`` client addresses are left to Ray."""
    env = os.environ.get("RAY_ADDRESS") or None
    target = env or address
    where = f"RAY_ADDRESS={env!r}" if env else f"--address {target!r}"
    if target is None or target == "local" or target.startswith("ray://"):
        return
    try:  # Ray's own resolution: RAY_ADDRESS, its latest-cluster file, running GCS processes
        from ray._private.services import canonicalize_bootstrap_address
        resolved = canonicalize_bootstrap_address(target)
    except ConnectionError:
        raise ConfigError(f"no running Ray cluster was found; {_FIX}") from None
    except ImportError:  # another Ray version: probe what was given
        resolved = None if target == "auto" else target
    except Exception:  # noqa: BLE001 (an address Ray cannot parse)
        raise ConfigError(f"{where} is invalid: write HOST:PORT of the Ray head") from None
    if not resolved:
        return
    host, _, port = resolved.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"{where} is invalid: write HOST:PORT of the Ray head")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as e:
        found = "" if target == resolved else f" (found {resolved})"
        raise ConfigError(f"no Ray cluster answers at {where}{found}: "
                          f"{e.strerror or type(e).__name__}; {_FIX}") from None


def connect(address: str = "auto") -> None:
    """Join the Ray cluster at ``address``, or say in one line how to point at one."""
    import ray

    from memckpt.runtime.coordinator.coordinator import COORDINATOR_NAMESPACE
    if ray.is_initialized():
        return
    probe(address)
    try:
        ray.init(address=address, namespace=COORDINATOR_NAMESPACE, logging_level=logging.ERROR,
                 log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = "no running Ray cluster was found" if address == "auto" else \
            f"no Ray cluster answers at {address!r}"
        raise ConfigError(f"{where} ({type(e).__name__}); {_FIX}") from None


def fetch_status(job: str, address: str = "auto") -> CoordinatorStatus:
    """The coordinator's status of the running job ``job`` (see ``Coordinator.status``)."""
    import ray

    from memckpt.runtime.coordinator.coordinator import COORDINATOR_NAMESPACE, coordinator_name
    connect(address)
    try:
        coord = ray.get_actor(coordinator_name(job), namespace=COORDINATOR_NAMESPACE)
    except ValueError:
        raise MemckptError(f"no running memckpt job named {job!r} on this cluster; pass --job "
                           "with the config's job_name") from None
    status: CoordinatorStatus = ray.get(coord.status.remote(), timeout=30)
    return status


def fetch_rank_detail(stores: Mapping[str, str],
                      timeout_s: float = 10.0) -> dict[str, Union[dict[int, tuple[float, int]], str]]:
    """Each node's ranks' (age of the last sign of life, step), asked of its replica store
    (``stores``: node -> the store actor's name, as the coordinator's status has them); a
    store that does not answer in ``timeout_s`` gets the reason instead."""
    import ray

    from memckpt.runtime.coordinator.state_store import COORDINATOR_NAMESPACE
    refs: dict[str, Any] = {}
    out: dict[str, Union[dict[int, tuple[float, int]], str]] = {}
    for node, name in stores.items():
        try:
            refs[node] = ray.get_actor(name, namespace=COORDINATOR_NAMESPACE).rank_detail.remote()
        except ValueError:
            out[node] = "its store is gone (the node was lost?)"
    for node, ref in refs.items():
        try:
            out[node] = {int(r): (float(a), int(s)) for r, (a, s) in
                         ray.get(ref, timeout=timeout_s).items()}
        except Exception as e:  # noqa: BLE001 - one store's silence is a line, not a crash
            out[node] = f"its store did not answer ({type(e).__name__})"
    return out
