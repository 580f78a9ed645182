"""The demo's workload: a small GPT, a learnable synthetic token stream, a state digest.

Everything here is plain PyTorch with no process-level assumptions, so the
single-process demo (:mod:`memckpt.demo.single_process`) and the multi-node one (DDP over
gloo with a sharded optimizer) share it:

* :class:`GPT` - token + position embedding, ``n_layers`` pre-LN transformer
  blocks (causal self-attention, GELU MLP, dropout), a final LayerNorm and an LM
  head whose weight *is* the token embedding (tied).
* :class:`MarkovTokens` - windows of a token stream drawn from a fixed random
  Markov chain (each token has a few likely successors), built deterministically
  from a seed, so the loss falls visibly within a few dozen steps.
* :func:`build` - ``(model, dataset)`` for a :class:`GPTConfig` and a seed,
  identical in every process that calls it with the same arguments.
* :func:`digest` / :func:`state_digest` - a sha256 over named tensors (name,
  dtype, shape, bytes, in name order) to compare two runs bit for bit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import Dataset


@dataclass(frozen=True)
class GPTConfig:
    """Model shape plus the synthetic data that goes with it.

    The defaults are the ~14M-parameter model (:data:`SMALL`); :data:`PRESETS`
    names smaller ones for quick demos and tests.
    """

    vocab_size: int = 8192
    ctx_len: int = 256
    d_model: int = 384
    n_layers: int = 6
    n_heads: int = 6
    mlp_ratio: int = 4
    dropout: float = 0.1
    # synthetic data: number of (input, target) windows, successors per token
    data_windows: int = 512
    data_branching: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "ctx_len", "d_model", "n_layers", "n_heads", "mlp_ratio",
                     "data_windows", "data_branching"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} is invalid: use a whole number >= 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"GPTConfig.d_model={self.d_model} must be divisible by "
                             f"n_heads={self.n_heads}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} is invalid: use 0 <= p < 1")
        if self.data_branching > self.vocab_size:
            raise ValueError("GPTConfig.data_branching cannot exceed vocab_size")

    def replace(self, **changes: Any) -> "GPTConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ~14M parameters: the "real" small model (slow-ish on CPU: about a second a step).
SMALL = GPTConfig()
# ~4.2M parameters: what `memckpt demo` trains by default (a step: ~0.2 s on 2 CPU cores).
MINI = GPTConfig(vocab_size=4096, ctx_len=128, d_model=256, n_layers=4, n_heads=4,
                 data_windows=100)
# ~120K parameters: for tests.
TINY = GPTConfig(vocab_size=256, ctx_len=32, d_model=64, n_layers=2, n_heads=2,
                 data_windows=40)
PRESETS: dict[str, GPTConfig] = {"tiny": TINY, "mini": MINI, "small": SMALL}


# ---- model ----------------------------------------------------------------------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LN: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-style decoder whose LM head shares its weight with the token embedding."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.ctx_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):  # residual projections, GPT-2 style
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_parameters(self) -> int:
        """Distinct parameters (the tied head counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """Logits ``(B, T, vocab)``, and the mean cross-entropy if ``targets`` is given."""
        b, t = idx.shape
        if t > self.cfg.ctx_len:
            raise ValueError(f"sequence of {t} tokens exceeds ctx_len={self.cfg.ctx_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def count_parameters(cfg: GPTConfig) -> int:
    """Parameter count of ``GPT(cfg)`` without allocating it (tied head counted once)."""
    d, v, f = cfg.d_model, cfg.vocab_size, cfg.mlp_ratio * cfg.d_model
    block = (2 * 2 * d) + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    return v * d + cfg.ctx_len * d + cfg.n_layers * block + 2 * d


# ---- data -------------------------------------------------------------------------------------

class MarkovTokens(Dataset):
    """``(input, target)`` windows of a token stream from a fixed random Markov chain.

    Each token has ``branching`` possible successors, taken with fixed skewed
    probabilities, so a model can drive the loss from ``ln(vocab)`` down towards
    the chain's entropy (about 1.2 nats for 4 successors). The chain and the
    stream depend only on ``seed`` (a private ``torch.Generator``; the global RNG
    is left alone), so every process builds the same dataset.
    """

    def __init__(self, vocab_size: int, ctx_len: int, n_windows: int, seed: int = 0,
                 branching: int = 4) -> None:
        self.vocab_size, self.ctx_len, self.n_windows = vocab_size, ctx_len, n_windows
        self.seed, self.branching = seed, branching
        g = torch.Generator().manual_seed(seed)
        # Successors are drawn Zipf-like from a shuffled vocabulary: common tokens are
        # learned within a few steps, the rare transitions keep it learning after.
        zipf = 1.0 / torch.arange(1, vocab_size + 1, dtype=torch.float64)
        ranked = torch.randperm(vocab_size, generator=g)
        successors = ranked[torch.multinomial(zipf, vocab_size * branching, replacement=True,
                                              generator=g)].view(vocab_size, branching)
        weights = torch.tensor([0.5 ** i for i in range(branching)], dtype=torch.float64)
        n = n_windows * ctx_len + 1
        choice = torch.multinomial(weights / weights.sum(), n, replacement=True, generator=g)
        start = int(torch.randint(vocab_size, (1,), generator=g))
        table, picks = successors.tolist(), choice.tolist()
        stream = [start]
        for i in range(1, n):
            stream.append(table[stream[-1]][picks[i]])
        self.tokens = torch.tensor(stream, dtype=torch.long)

    def __len__(self) -> int:
        return self.n_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.n_windows:
            raise IndexError(i)
        s = i * self.ctx_len
        return self.tokens[s:s + self.ctx_len], self.tokens[s + 1:s + self.ctx_len + 1]


def build(cfg: GPTConfig = SMALL, seed: int = 0) -> tuple[GPT, MarkovTokens]:
    """The model (initialised from ``seed``) and its dataset (also from ``seed``).

    Seeds the global torch RNG with ``seed`` for the initialisation: call it
    before anything else that draws random numbers, in every process alike.
    """
    torch.manual_seed(seed)
    model = GPT(cfg)
    data = MarkovTokens(cfg.vocab_size, cfg.ctx_len, cfg.data_windows, seed=seed,
                        branching=cfg.data_branching)
    return model, data


# ---- digest -------------------------------------------------------------------------------------

def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over (name, dtype, shape, bytes) of each tensor, in name order.

    Independent of the order given, of the process and of the device (tensors are
    hashed as CPU bytes). Names must be unique.
    """
    items = sorted(tensors, key=lambda kv: kv[0])
    h = hashlib.sha256()
    seen = set()
    for name, t in items:
        if name in seen:
            raise ValueError(f"digest: duplicate tensor name {name!r}")
        seen.add(name)
        for part in (name, str(t.dtype), repr(tuple(t.shape))):
            h.update(part.encode())
            h.update(b"\0")
        h.update(_tensor_bytes(t))
    return h.hexdigest()


def _unwrap(model: nn.Module) -> nn.Module:
    # DistributedDataParallel (and similar wrappers) keep the real model in .module
    from torch.nn.parallel import DistributedDataParallel
    return model.module if isinstance(model, DistributedDataParallel) else model


def _as_named(kind: str, obj: Any) -> dict[str, Any]:
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    return {kind: obj}


def named_state_tensors(models: Any, optimizers: Any = None) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and buffer, and every optimizer state tensor keyed by parameter name.

    ``models``/``optimizers`` are one object or a dict of named ones. Optimizer
    state is named after the parameter it belongs to (not its index), and
    non-tensor state values (an int ``step``) become 0-d tensors. A sharded
    optimizer (``ZeroRedundancyOptimizer``) contributes the state of the
    parameters this rank owns; consolidate it first for a global digest.
    """
    out: list[tuple[str, torch.Tensor]] = []
    pnames: dict[int, str] = {}
    for mname, m in _as_named("model", models).items():
        m = _unwrap(m)
        for key, t in m.state_dict(keep_vars=False).items():
            out.append((f"model/{mname}/{key}", t))
        for fqn, p in m.named_parameters():
            pnames.setdefault(id(p), f"{mname}/{fqn}")
    for oname, opt in _as_named("optimizer", optimizers).items():
        for p, st in opt.state.items():
            if id(p) not in pnames:
                raise ValueError(f"optimizer {oname!r} holds state for a parameter of shape "
                                 f"{tuple(p.shape)} that belongs to none of the models given")
            for k, v in st.items():
                if not isinstance(v, torch.Tensor):
                    v = torch.tensor(v)
                out.append((f"optim/{oname}/{pnames[id(p)]}/{k}", v))
    return out


def state_digest(models: Any, optimizers: Any = None) -> str:
    """:func:`digest` of :func:`named_state_tensors`: equal iff the two states are bit-equal."""
    return digest(named_state_tensors(models, optimizers))
