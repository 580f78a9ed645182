"""``memckpt bench ray-train``: memckpt inside Ray Train against its own checkpoints."""
