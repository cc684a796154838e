"""The model the end-to-end benchmark trains: a GPT-style decoder written here (no downloads).

Pre-norm blocks (LayerNorm, causal self-attention through scaled_dot_product_attention, a 4x GELU MLP),
learned position embeddings and an untied output head. Every parameter gets its own gradient, the shape
an optimizer sees in a real LLM: a few large matrices per layer plus small norm vectors.

Param dtype and compute dtype are separate. The params may be bf16 (what offload_adam is for) while the
activations run in fp32: each layer casts its weight to the activation dtype on use. This matters on CPUs
without bf16 matrix units (no AVX512-BF16 or AMX), where a bf16 GEMM runs some 40x slower than fp32 and
would drown the optimizer in the timing; the weights the forward sees are still exactly the bf16 params.
On a GPU the compute dtype is the param dtype.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 64
    layers: int = 4
    width: int = 256
    heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "layers", "width", "heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.width % self.heads:
            raise ValueError(f"GPTConfig.width ({self.width}) must be a multiple of heads ({self.heads})")

    def num_params(self) -> int:
        """Parameter count, computed from the shapes (equals sum(p.numel()) of the built model)."""
        d, v = self.width, self.vocab_size
        per_layer = 4 * d          # two LayerNorms (weight + bias)
        per_layer += 3 * d * d     # qkv
        per_layer += d * d         # attention output projection
        per_layer += 8 * d * d     # MLP up (d -> 4d) and down (4d -> d)
        return v * d + self.seq_len * d + self.layers * per_layer + 2 * d + d * v


def config_for(layers: int, width: int, vocab_size: int, seq_len: int) -> GPTConfig:
    """The shape family of the benchmark: head dimension 64 (fewer heads only when width < 64)."""
    return GPTConfig(vocab_size=vocab_size, seq_len=seq_len, layers=layers, width=width,
                     heads=max(1, width // 64))


# Named sizes (layers, width); the GPU ones follow GPT-2/GPT-3's shapes. The size sweep walks this list.
SIZES: dict[str, tuple[int, int]] = {
    "tiny": (2, 64),
    "small": (4, 256),
    "medium": (6, 384),
    "124m": (12, 768),
    "350m": (24, 1024),
    "760m": (24, 1536),
    "1.3b": (24, 2048),
    "2.7b": (32, 2560),
    "6.7b": (32, 4096),
    "13b": (40, 5120),
    "22b": (48, 6144),
    "37b": (60, 7168),
    "52b": (64, 8192),
    "66b": (80, 8192),
}


class _Linear(nn.Module):
    """y = x @ W^T, W cast to the activation dtype on use (a no-op when they already match)."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype))


class _LayerNorm(nn.Module):
    def __init__(self, width: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(width, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.bias.to(x.dtype))


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = _LayerNorm(cfg.width, dtype)
        self.qkv = _Linear(cfg.width, 3 * cfg.width, dtype)
        self.proj = _Linear(cfg.width, cfg.width, dtype)
        self.ln2 = _LayerNorm(cfg.width, dtype)
        self.up = _Linear(cfg.width, 4 * cfg.width, dtype)
        self.down = _Linear(4 * cfg.width, cfg.width, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


class GPT(nn.Module):
    """Decoder-only transformer; `forward(tokens, targets)` returns the mean cross-entropy in fp32."""

    def __init__(self, cfg: GPTConfig, param_dtype: torch.dtype = torch.float32,
                 compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.compute_dtype = compute_dtype  # None: the param dtype
        self.tok_emb = nn.Parameter(torch.empty(cfg.vocab_size, cfg.width, dtype=param_dtype))
        self.pos_emb = nn.Parameter(torch.empty(cfg.seq_len, cfg.width, dtype=param_dtype))
        self.blocks = nn.ModuleList(_Block(cfg, param_dtype) for _ in range(cfg.layers))
        self.ln_f = _LayerNorm(cfg.width, param_dtype)
        self.head = _Linear(cfg.width, cfg.vocab_size, param_dtype)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds the model's seq_len {self.cfg.seq_len}")
        dtype = self.compute_dtype or self.tok_emb.dtype
        x = F.embedding(tokens, self.tok_emb).to(dtype) + self.pos_emb[:t].to(dtype)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        # The loss in fp32 whatever the compute dtype, so curves compare on one scale.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


@torch.no_grad()
def init_weights(model: GPT, seed: int = 0) -> None:
    """GPT-2's init, drawn in fp32 from one seeded generator in a fixed order, then cast to the param
    dtype: every contender starts from the same weights (bf16 ones are the fp32 draw rounded)."""
    device = model.tok_emb.device
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    resid_std = 0.02 / math.sqrt(2 * model.cfg.layers)  # residual branches scaled down by depth
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            p.zero_()
        elif p.ndim == 1:  # LayerNorm gains
            p.fill_(1.0)
        else:
            std = resid_std if name.endswith(("proj.weight", "down.weight")) else 0.02
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32) * std)


def build_model(cfg: GPTConfig, device: torch.device | str, param_dtype: torch.dtype,
                compute_dtype: torch.dtype | None = None, seed: int = 0) -> GPT:
    """Builds the params directly on `device` in `param_dtype` (no full fp32 copy of a large model
    anywhere: init draws one tensor at a time) and initializes them deterministically."""
    with torch.device(device):
        model = GPT(cfg, param_dtype=param_dtype, compute_dtype=compute_dtype)
    init_weights(model, seed)
    return model
