"""Decoder-only language model over input embeddings (Llama shape, small).

Pre-norm blocks: ``x + attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``,
RoPE from the batch's ``position_ids``, attention layout from the batch (pack:
block-diagonal causal; pad: causal + key padding). The decoder takes
embeddings, not ids, so the VLM can splice image features in first; it returns
final-normed hidden states and leaves the (tied) head to the caller, which only
projects the positions it needs.
Cost per layer: O(T * d^2) for the projections + attention (see attention.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ray_mmbatch.models.builtin.attention import AttentionLayout
from ray_mmbatch.models.builtin.layers import RMSNorm, SelfAttention, SwiGLU
from ray_mmbatch.models.builtin.rope import apply_rope, rope_cos_sin


class DecoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.attn_norm = RMSNorm(dim)
        self.attn = SelfAttention(dim, heads, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.mlp = SwiGLU(dim, int(dim * mlp_ratio))

    def forward(self, x, layout, rotate):
        x = x + self.attn(self.attn_norm(x), layout, rotate)
        return x + self.mlp(self.mlp_norm(x))


class Decoder(nn.Module):
    def __init__(self, dim: int, layers: int, heads: int, mlp_ratio: float, rope_theta: float):
        super().__init__()
        if (dim // heads) % 2:
            raise ValueError(f"LM head dim {dim}/{heads} must be even for RoPE")
        self.head_dim = dim // heads
        self.rope_theta = rope_theta
        self.blocks = nn.ModuleList(DecoderBlock(dim, heads, mlp_ratio) for _ in range(layers))
        self.norm = RMSNorm(dim)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
        """x [B, T, d], position_ids [B, T] -> hidden [B, T, d]."""
        cos, sin = rope_cos_sin(position_ids, self.head_dim, self.rope_theta)
        cos, sin = cos[:, None], sin[:, None]                 # broadcast over heads

        def rotate(q, k):
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

        for block in self.blocks:
            x = block(x, layout, rotate)
        return self.norm(x)
