"""Config for examples/fsdp_job.py: 3 FSDP2 ranks on 3 nodes, ring placement, 1 peer replica.

Each rank's shard holds a different third of the model and of AdamW's state: its only
other copy is the replica on the next node.
"""

import memckpt

config = memckpt.Config(
    job_name="fsdp-example",
    # gpus_per_worker=1 (and backend "auto") trains on a CUDA mesh over NCCL instead
    workers=memckpt.WorkersConfig(num_workers=3, workers_per_node=1, cpus_per_worker=1),
    placement=memckpt.PlacementConfig(strategy="ring", replicas=1),
    snapshot_every=1,
    failure=memckpt.FailureConfig(heartbeat_interval_s=0.5, heartbeat_timeout_s=5.0,
                                  max_restarts=3, on_fall_behind="wait"),
)
