"""``memckpt bench elastic``: a node lost, the first step at fewer ranks (``command``)."""
