"""``memckpt bench lora``: a PEFT LoRA job, where only the adapter changes from step to step."""
