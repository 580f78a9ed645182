"""The single-process snapshot engine: host RAM regions, populate, copy and seal, the stop file."""
