"""Building blocks shared by the vision encoder and the decoder.

``SelfAttention`` is position-agnostic: the caller passes a ``rotate(q, k)``
function (1-D RoPE for text, 2-D for patches) and an ``AttentionLayout``, so
one module serves both towers and every attention backend.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ray_mmbatch.models.builtin.attention import AttentionLayout, attend

Rotate = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 (bf16 squares lose too much)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, bias: bool):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"width {dim} is not divisible by {n_heads} heads")
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.out = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor, layout: AttentionLayout, rotate: Rotate) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = rotate(qkv[0], qkv[1])
        y = attend(q, k, qkv[2], layout)                      # [B, H, L, hd]
        return self.out(y.transpose(1, 2).reshape(b, n, d))


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """GPT-style init: small normal weights, zero biases (norms keep their ones)."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)
