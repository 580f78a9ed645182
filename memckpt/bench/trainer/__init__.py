"""``memckpt bench trainer``: the Hugging Face Trainer's own checkpoints vs memckpt's snapshots."""
