"""Benchmarks behind ``memckpt bench``: each one is a module with ``add_arguments`` and ``main``.

``memckpt bench snapshot`` measures the per-step stall of an in-RAM snapshot against a raw
memcpy and ``torch.save``; ``persist`` the persisted tiers against a raw write; ``recovery``
recovery after a killed worker or a lost node against restart + torch.load; ``compare``
memckpt side by side with torch.save, DCP and Ray Train.

Each benchmark has its own room, ``memckpt/bench/NAME/``: ``command`` (its arguments, the run,
``main``; the module docstring is the command's description) and, where the benchmark is more
than a loop, ``measure`` (its measurements), ``rows`` (the typed rows built from them) and
``report``; recovery adds its synthetic ``workload`` and its Ray ``bench_actors``, compare the
``alternatives`` it measures and its ``plot``. Shared: ``common`` (argument types, formatting,
scratch directories, a measurement in a fresh process, the report's head and tail) and
``foreign_load`` (what other processes take from the CPU meanwhile). Modules here import
torch and Ray lazily, so building the command line stays cheap.
"""
