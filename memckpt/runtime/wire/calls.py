"""Names of the replica store actor's Ray calls that a rank depends on: the driver declares
them when it starts the store (:mod:`memckpt.runtime.driver.actors`), the store serves them
(:mod:`memckpt.runtime.node.uplink`) and a rank calls them
(:mod:`memckpt.runtime.worker.node_link`)."""

COMMIT_GROUP = "commit"  # the store's concurrency group for ranks waiting on a commit
COMMIT_WAITERS = 64  # its threads: a node's ranks waiting at once (more just queue)
