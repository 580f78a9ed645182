"""What a checkpoint is: the shard format, state capture (DTensor, data position), digests,
the DCP reader over shards and resharding into another layout."""
