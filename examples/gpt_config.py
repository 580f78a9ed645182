"""Config for examples/gpt_job.py: 3 ranks on 3 nodes, ring placement, 1 peer replica."""

import memckpt

config = memckpt.Config(
    job_name="gpt-example",
    workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
    # With a 4th node to spare, standby_nodes=1 keeps every node's replica on it, and a
    # dead node's rank restarts there with a local restore.
    placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
    snapshot_every=1,
    failure=memckpt.FailureConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                  max_restarts=3, on_fall_behind="wait"),
)
