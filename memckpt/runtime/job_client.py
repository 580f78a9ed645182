"""Find a running job's coordinator from another process (``memckpt status`` and ``kill``)."""

from __future__ import annotations

from memckpt.errors import ConfigError, MemckptError


def connect(address: str = "auto") -> None:
    """Join the Ray cluster at ``address``, or say in one line how to point at one."""
    import ray

    from memckpt.runtime.coordinator import COORDINATOR_NAMESPACE
    if ray.is_initialized():
        return
    try:
        ray.init(address=address, namespace=COORDINATOR_NAMESPACE, logging_level="ERROR",
                 log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = "no running Ray cluster was found" if address == "auto" else \
            f"no Ray cluster answers at {address!r}"
        raise ConfigError(f"{where} ({type(e).__name__}); start the job first, or pass "
                          "--address HOST:PORT (or set RAY_ADDRESS) to the head of the "
                          "cluster it runs on") from None


def fetch_status(job: str, address: str = "auto") -> dict:
    """The coordinator's status of the running job ``job`` (see ``Coordinator.status``)."""
    import ray

    from memckpt.runtime.coordinator import COORDINATOR_NAMESPACE, coordinator_name
    connect(address)
    try:
        coord = ray.get_actor(coordinator_name(job), namespace=COORDINATOR_NAMESPACE)
    except ValueError:
        raise MemckptError(f"no running memckpt job named {job!r} on this cluster; pass --job "
                           "with the config's job_name") from None
    return ray.get(coord.status.remote(), timeout=30)
