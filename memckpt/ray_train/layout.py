"""Pure decisions of the Ray Train front door: the job's config for the run Ray Train
starts, replica holders over the nodes Ray Train placed the workers on, and the
persisted tier Ray Train's checkpoints point into. No Ray."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Optional

from memckpt.policy import placement
from memckpt.config import Config, PersistTier, WorkersConfig
from memckpt.errors import ConfigError, PlacementError
from memckpt.policy.recovery_plan import repair_holders

TIER_FOLDER = "memckpt"  # under Ray Train's experiment folder
KEEP_ALL = 10 ** 9  # Ray Train's CheckpointConfig(num_to_keep) decides what goes
# the chaos targets a Ray Train run carries out: a rank's own signal, or (several ranks at
# once, a node) the callback's watchdog
RAY_TRAIN_CHAOS = ("worker", "node")


def run_config(config: Config, num_workers: int, tier: Optional[PersistTier]) -> Config:
    """``config`` for a run of ``num_workers`` Ray Train workers, with the tier Ray Train's
    checkpoints live in appended (validated again: placement must suit that many nodes)."""
    if not isinstance(config, Config):
        raise ConfigError(f"MemckptCallback(config) needs a memckpt.Config, got "
                          f"{type(config).__name__}")
    other = sorted({ev.target for ev in config.chaos} - set(RAY_TRAIN_CHAOS))
    if other:
        raise ConfigError(f"chaos targets {other} are not available under Ray Train (only "
                          f"{' and '.join(map(repr, RAY_TRAIN_CHAOS))}, at a step): drop them "
                          "or use memckpt.run / memckpt kill for store and coordinator drills")
    phased = [ev for ev in config.chaos if ev.during is not None]
    if phased:
        raise ConfigError(f"chaos during={phased[0].during!r} is not available under Ray Train "
                          "(its group restart is Ray Train's, with no phases memckpt can fire "
                          "in): schedule the fault at a step, or drill with memckpt.run")
    if any(ev.at_byte is not None for ev in config.chaos):
        raise ConfigError("chaos at_byte is not available under Ray Train (its faults fire as "
                          "a rank finishes a step, not mid-transfer): schedule the fault at a "
                          "step, or drill with memckpt.run")
    w = config.workers
    workers = WorkersConfig(num_workers=num_workers, workers_per_node=1,
                            cpus_per_worker=w.cpus_per_worker, gpus_per_worker=w.gpus_per_worker,
                            backend=w.backend)
    tiers = config.persistence + ((tier,) if tier is not None else ())
    # Ray Train places and restarts every worker: no standby nodes, no warm spares.
    return dataclasses.replace(config, workers=workers, persistence=tiers,
                               placement=dataclasses.replace(config.placement, standby_nodes=0),
                               failure=dataclasses.replace(config.failure, warm_spares=False))


def train_tier(experiment_path: str, filesystem: str, every: int) -> PersistTier:
    """The persisted tier inside Ray Train's experiment folder, so a reported checkpoint
    is the memckpt checkpoint itself (nothing is copied twice). ``filesystem`` is
    pyarrow's ``type_name`` of the run's storage filesystem."""
    if filesystem == "local":
        root = experiment_path
    elif filesystem == "s3":
        root = f"s3://{experiment_path.lstrip('/')}"
    else:
        raise ConfigError(f"RunConfig(storage_path=...) on a {filesystem!r} filesystem is not "
                          "supported by memckpt's persisted tier: use a local/shared path or "
                          "s3://, or MemckptCallback(checkpoint_every=None)")
    return PersistTier(uri=f"{root.rstrip('/')}/{TIER_FOLDER}", every=every, keep_last=KEEP_ALL)


def holders_for(assignment: Mapping[int, str], config: Config,
                previous: Optional[Mapping[int, tuple[str, ...]]] = None,
                domains: Optional[Mapping[str, str]] = None,
                strict: bool = False) -> dict[int, tuple[str, ...]]:
    """Replica holders of each rank over the nodes its workers run on (in rank order),
    by the configured strategy; where the strategy does not fit this many nodes (a
    restart on fewer nodes), the previous holders kept where they can be, and the
    least-loaded other nodes. ``domains`` (node -> the value of its
    ``placement.failure_domain`` label): copies outside the rank's failure domain.

    ``strict`` (the first worker group): where the nodes cannot keep every copy outside
    its rank's domain, :class:`PlacementError` names the label and the domains, as
    ``memckpt.run`` refuses such a job at start. Otherwise (a restart) such copies go to
    nodes inside the domain (:func:`repair_holders`), as a recovery does."""
    p = config.placement
    nodes = list(dict.fromkeys(assignment[r] for r in sorted(assignment)))
    if not p.replicas or len(nodes) < 2:
        return {r: () for r in assignment}
    k = min(p.replicas, len(nodes) - 1)
    try:
        plan = placement.replica_plan(nodes, p.strategy, k, p.group_size, domains,
                                      p.failure_domain)
        return placement.rank_holders(dict(assignment), plan)
    except PlacementError:
        if strict and domains is not None:
            placement.check_domains(nodes, domains, k, p.failure_domain)
        return repair_holders(dict(previous or {}), assignment, nodes, p.replicas, domains)
