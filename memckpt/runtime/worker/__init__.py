"""A worker actor's process (one rank): the context the training function gets, its snapshot
engine, the replicator that streams its shards to their holders."""
