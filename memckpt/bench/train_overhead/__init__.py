"""``memckpt bench train-overhead``: what a snapshot every step costs a training loop."""
