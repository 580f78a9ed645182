"""The cluster's nodes as every process sees them: which are alive, and pinning a task or an
actor to one. Shared by the driver, the node side and the operator tools."""

from __future__ import annotations


def on_node(node_id: str):
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


def alive_node_ids() -> set[str]:
    import ray
    return {n["NodeID"] for n in ray.nodes() if n["Alive"]}
