"""Benchmarks behind ``memckpt bench``: each one is a module with ``add_arguments`` and ``main``.

``memckpt bench snapshot`` measures the per-step stall of an in-RAM snapshot against a raw
memcpy and ``torch.save``; ``persist`` the persisted tiers against a raw write; ``recovery``
recovery after a killed worker or a lost node against restart + torch.load; ``compare``
memckpt side by side with torch.save, DCP and Ray Train.

Each benchmark NAME is the command (``NAME.py``: its arguments, the run, ``main``), its
measurements (``NAME_measure.py``), the rows built from them (``NAME_rows.py``, where that is
more than a loop) and its report (``NAME_report.py``); ``plot`` draws compare's PNG,
``alternatives`` holds the methods compare measures, ``recovery_job`` / ``recovery_actors`` the
job and the Ray actors recovery runs. Shared: ``common`` (argument types, formatting, scratch
directories, a measurement in a fresh process, the report's head and tail) and
``foreign_load`` (what other processes take from the CPU meanwhile). Modules here import
torch and Ray lazily, so building the command line stays cheap.
"""
