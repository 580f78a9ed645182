"""What a worker and its node's replica store both speak, so that neither imports the
other's room: where shards lie in shared memory (``ram_files.py``), the TCP data plane's
wire and the worker's end of it (``data_plane.py``; the store's end is
:mod:`memckpt.runtime.node.shard_server`), and the names of the store's Ray calls a rank
relies on (``calls.py``). Imports no other room of the runtime, nor Ray or torch."""
