"""``memckpt bench snapshot``: the per-step stall of a snapshot and what it is measured against."""
