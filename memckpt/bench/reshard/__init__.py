"""``memckpt bench reshard``: a resharded restore (disk, RAM) against dcp.load."""
