"""Fault injection, run by the processes it hits: the schedule the driver keeps and a worker
fires at its step (``faults.py``: ``FaultInjector``, the config's chaos), and the signals
the driver, the Ray Train callback and ``memckpt kill`` deliver to a worker, a store, the
coordinator or a whole node. Drills import ``FaultInjector`` from :mod:`memckpt.testing`."""
