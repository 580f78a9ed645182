"""Benchmarks behind ``memckpt bench``: each one is a module with ``add_arguments`` and ``main``.

``memckpt bench snapshot`` measures the per-step stall of an in-RAM snapshot against a raw
memcpy and ``torch.save``. Modules here import torch lazily, so building the command line
stays cheap.
"""
