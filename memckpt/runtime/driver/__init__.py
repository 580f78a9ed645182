"""The driver's process (``memckpt.run``): its state machine, the coordinator and stores it
starts, its worker pool and spares, recovery. Ray Train's controller uses :mod:`.actors`."""
