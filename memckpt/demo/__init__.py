"""What ``memckpt demo`` runs: a small GPT job, a fault, a recovery, a comparison.

:mod:`memckpt.demo.model` holds the workload (model, synthetic data, state
digest), shared by every demo mode; :mod:`memckpt.demo.single_process` is the
single-process demo; :mod:`memckpt.cli.demo` is the command. Importing this
package imports nothing heavy.
"""
