"""Helper module for tests/test_lora.py (not a test module): a PEFT LoRA fine-tune of a small
Llama-shaped model (grouped-query attention), its base frozen, as each rank's training:
memckpt's own loop (:class:`LoraRankJob`) and the Hugging Face ``Trainer`` front door
(:class:`LoraTrainerJob`). Shipped to the workers by value (they cannot import tests/)."""

from __future__ import annotations

from typing import Any

from _trainer_result import trainer_result

VOCAB, SEQ = 256, 16


def build_model(seed: int = 0) -> Any:
    """A 2-layer Llama (hidden 128, 4 heads over 2 key/value heads), LoRA r=8 on the
    attention's q and v projections; the base (about 95% of the state) frozen."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ))
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=["q_proj", "v_proj"])
    return get_peft_model(base, lora)


def tokens(n: int, seed: int) -> Any:
    import torch
    return torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def frozen_share(model: Any, optimizer: Any) -> float:
    """The frozen parameters' bytes over the whole state (parameters, buffers, moments)."""
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    total += sum(v.numel() * v.element_size() for st in optimizer.state.values()
                 for v in st.values() if hasattr(v, "numel"))
    return frozen / total


class LoraRankJob:
    """memckpt's loop: DDP over gloo, AdamW on the adapter, a loss reported every step."""

    def __init__(self, steps: int) -> None:
        self.steps = steps

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import memckpt

        model = build_model()
        distributed = dist.is_available() and dist.is_initialized()
        # a fixed bucket layout: a restarted worker sums gradients in the same order
        net = DDP(model, find_unused_parameters=True) if distributed else model
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        state = memckpt.TrainState(model=model, optimizer=opt)
        start = ctx.restore(state)
        data = tokens(64 * ctx.world_size, seed=1)
        net.train()
        for step in range(start + 1, self.steps + 1):
            # the step's batch, this rank's share: a pure function of the step
            at = (step * ctx.world_size + ctx.rank) * 4 % len(data)
            ids = data[at: at + 4]
            opt.zero_grad(set_to_none=True)
            loss = net(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            if distributed:
                dist.all_reduce(mean)
                mean /= ctx.world_size
            ctx.step(state, step, loss=mean.item())
        return {"frozen_share": frozen_share(model, opt)}


class LoraTrainerJob:
    """The Hugging Face ``Trainer`` on the LoRA model, memckpt attached to the rank's
    context. Returns (and writes to ``<out>/rank<r>.json``) the Trainer's log without
    wall-clock figures, a hash of the final parameters, and the step memckpt resumed from."""

    def __init__(self, out: str, samples: int) -> None:
        self.out, self.samples = out, samples

    def __call__(self, ctx: Any) -> dict[str, Any]:
        import torch
        from torch.utils.data import Dataset
        from transformers import Trainer, TrainingArguments

        from memckpt.integrations.hf import attach

        class Tokens(Dataset):
            def __init__(self, n: int, seed: int) -> None:
                self.ids = tokens(n, seed)

            def __len__(self) -> int:
                return len(self.ids)

            def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
                return {"input_ids": self.ids[i], "labels": self.ids[i]}

        out = f"{self.out}/rank{ctx.rank}"
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=4, num_train_epochs=2, learning_rate=1e-3,
            warmup_steps=2, logging_steps=1, save_strategy="no", report_to=[], seed=0,
            use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=build_model(), args=args, train_dataset=Tokens(self.samples, 1))
        hooks = attach(trainer, ctx)
        trainer.train()
        return trainer_result(trainer, hooks, self.out, ctx.rank)
