"""The ``memckpt`` command: one module per sub-command, dispatched by :mod:`memckpt.cli.main`."""

from memckpt.cli.main import main

__all__ = ["main"]
