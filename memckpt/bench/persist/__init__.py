"""``memckpt bench persist``: the persisted tiers against a raw write of the same bytes."""
