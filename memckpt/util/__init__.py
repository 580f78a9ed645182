"""Small helpers with no memckpt dependencies: crash-safe files, a free TCP port."""
