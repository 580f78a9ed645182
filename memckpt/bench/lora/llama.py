"""The job ``memckpt bench lora`` checkpoints: a small Llama-shaped transformers model (grouped
query attention: fewer key/value heads than query heads) wrapped with PEFT LoRA (r=8 on q_proj
and v_proj), trained by AdamW on a fixed batch. The base stays frozen; only the adapter and
its AdamW moments change from step to step. Everything is seeded: two jobs built with the same
preset and seed are the same bytes, step for step."""

from __future__ import annotations

import random
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

LORA_RANK = 8
LORA_TARGETS = ("q_proj", "v_proj")


@dataclass(frozen=True)
class Preset:
    hidden: int
    layers: int
    heads: int
    kv_heads: int  # < heads: grouped query attention, as in Llama 2 70B and Llama 3
    intermediate: int
    vocab: int
    seq: int  # tokens per sequence of the training batch
    batch: int


# tiny: the smoke test's; small (the default): well under a minute on 2 cores; large: the
# figures in docs/benchmarks.md (~0.6 GiB of state in float32)
PRESETS: dict[str, Preset] = {
    "tiny": Preset(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=344, vocab=4096,
                   seq=16, batch=2),
    "small": Preset(hidden=512, layers=4, heads=8, kv_heads=2, intermediate=1376, vocab=8192,
                    seq=32, batch=2),
    "large": Preset(hidden=1024, layers=8, heads=16, kv_heads=4, intermediate=2752, vocab=32000,
                    seq=32, batch=1),
}
DEFAULT_PRESET = "small"


class TrainableOnly(torch.nn.Module):
    """The trainable parameters of ``model`` alone (the same tensors, not copies): what a
    ``TrainState`` holds when only the adapter is checkpointed."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        for name, p in model.named_parameters():
            if p.requires_grad:
                self.register_parameter(name.replace(".", "__"), p)


class LoraJob:
    """The PEFT model, its AdamW over the trainable parameters, and a fixed batch."""

    def __init__(self, preset: Preset, seed: int) -> None:
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        config = LlamaConfig(hidden_size=preset.hidden, num_hidden_layers=preset.layers,
                             num_attention_heads=preset.heads, num_key_value_heads=preset.kv_heads,
                             intermediate_size=preset.intermediate, vocab_size=preset.vocab,
                             max_position_embeddings=max(128, preset.seq),
                             tie_word_embeddings=False)
        lora = LoraConfig(r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0,
                          target_modules=list(LORA_TARGETS))
        self.preset = preset
        with warnings.catch_warnings():  # transformers' deprecation notes, as peft calls it
            warnings.simplefilter("ignore", FutureWarning)
            self.model: Any = get_peft_model(LlamaForCausalLM(config), lora)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-3)
        gen = torch.Generator().manual_seed(seed)
        self.batch = torch.randint(0, preset.vocab, (preset.batch, preset.seq), generator=gen)
        self.losses: list[float] = []

    def step(self) -> None:
        """One training step: forward, backward, AdamW's update of the adapter."""
        loss = self.model(input_ids=self.batch, labels=self.batch).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(float(loss.detach()))

    def frozen_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters()
                   if not p.requires_grad)

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.trainable)

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
