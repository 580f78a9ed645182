"""``memckpt bench fsdp-stall``: the snapshot stall of an FSDP2 job (``command``)."""
