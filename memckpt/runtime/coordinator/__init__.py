"""The coordinator's process: one named actor per job, and its Ray metrics. Never imports
the driver's or a worker's code, nor torch."""
