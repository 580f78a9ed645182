"""Each node's long-lived actors: the replica store and its data plane, and the Ray Train
janitor. Never imports the driver's or a worker's code, nor torch."""
