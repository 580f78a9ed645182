"""Front doors for trainers people already use: Hugging Face ``transformers.Trainer``
(:mod:`memckpt.integrations.hf`) and PyTorch Lightning (:mod:`memckpt.integrations.lightning`).

Each module imports its library when it is imported itself; ``import memckpt`` never does.
"""
