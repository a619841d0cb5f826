"""Vision tower: uint8 patches -> one LM-width feature per merged image token.

Pipeline (Qwen2-VL shape, small)::

    patches uint8 [P, 3*ps*ps]  --(/255 - mean)/std on the device-->  fp32
      -> Linear patch embed [P, Dv]
      -> blocks: pre-LN, attention isolated per image (pack layout from
         vision_cu_seqlens, not causal) with 2-D RoPE, GELU MLP
      -> LN, spatial merge: m*m consecutive patches (one merge window, thanks to
         the merge-window order) -> [P/m^2, m^2*Dv]
      -> MLP projector -> [P/m^2, d_model]

Normalizing on the device keeps the host->device copy at 1 byte per channel.
Cost: O(P * Dv^2) per layer plus attention O(sum over images of P_i^2) work.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ray_mmbatch.models.builtin.attention import pack_layout
from ray_mmbatch.models.builtin.layers import SelfAttention
from ray_mmbatch.models.builtin.rope import apply_rope_2d, patch_positions, rope_cos_sin

# CLIP statistics, as used by Qwen2-VL's image processor.
IMAGE_MEAN = (0.48145466, 0.4578275, 0.40821073)
IMAGE_STD = (0.26862954, 0.26130258, 0.27577711)


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = SelfAttention(dim, heads, bias=True)
        self.norm2 = nn.LayerNorm(dim)
        hidden = int(dim * mlp_ratio)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))

    def forward(self, x, layout, rotate):
        x = x + self.attn(self.norm1(x), layout, rotate)
        return x + self.mlp(self.norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, patch_size: int, merge_size: int, dim: int, layers: int, heads: int,
                 mlp_ratio: float, out_dim: int, rope_theta: float, attention: str):
        super().__init__()
        if dim % heads or (dim // heads) % 4:
            raise ValueError(f"vision head dim {dim}/{heads} must be a multiple of 4 (2-D RoPE halves)")
        self.patch_size, self.merge_size, self.attention = patch_size, merge_size, attention
        self.rope_theta = rope_theta
        self.head_dim = dim // heads
        self.patch_dim = 3 * patch_size * patch_size
        self.embed = nn.Linear(self.patch_dim, dim)
        self.blocks = nn.ModuleList(VisionBlock(dim, heads, mlp_ratio) for _ in range(layers))
        self.merge_norm = nn.LayerNorm(dim)
        merged = dim * merge_size * merge_size
        self.projector = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, out_dim))

    def forward(self, patches: torch.Tensor, grid_thw: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """patches uint8 [P, 3*ps*ps], grid_thw [n, 3], cu_seqlens [n+1] -> [P / m^2, out_dim]."""
        n_patches = patches.shape[0]
        if patches.ndim != 2 or patches.shape[1] != self.patch_dim:
            raise ValueError(f"patches must be [P, {self.patch_dim}] (3*{self.patch_size}^2), "
                             f"got {tuple(patches.shape)}")
        per_image = (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).long()
        if int(per_image.sum()) != n_patches:
            raise ValueError(f"image_grid_thw accounts for {int(per_image.sum())} patches, "
                             f"patches has {n_patches}")
        expected_cu = torch.cat([per_image.new_zeros(1), per_image.cumsum(0)])
        if not torch.equal(cu_seqlens.to(expected_cu), expected_cu):
            raise ValueError(f"vision_cu_seqlens {cu_seqlens.tolist()} disagrees with image_grid_thw "
                             f"(expected {expected_cu.tolist()})")
        pos = patch_positions(grid_thw, self.merge_size).to(patches.device)
        half = self.head_dim // 2
        rows = rope_cos_sin(pos[:, 0], half, self.rope_theta)
        cols = rope_cos_sin(pos[:, 1], half, self.rope_theta)

        def rotate(q, k):
            return apply_rope_2d(q, rows, cols), apply_rope_2d(k, rows, cols)

        layout = pack_layout(cu_seqlens, n_patches, causal=False, backend=self.attention, device=patches.device)
        # Constants, not buffers: DDP would otherwise broadcast them before every forward.
        mean = torch.tensor(IMAGE_MEAN, device=patches.device).view(1, 3, 1)
        std = torch.tensor(IMAGE_STD, device=patches.device).view(1, 3, 1)
        x = (patches.reshape(n_patches, 3, -1).float() / 255.0 - mean) / std
        x = self.embed(x.reshape(n_patches, -1))[None]               # [1, P, Dv]
        for block in self.blocks:
            x = block(x, layout, rotate)
        x = self.merge_norm(x[0])
        x = x.reshape(n_patches // self.merge_size ** 2, -1)      # one merge window per row
        return self.projector(x)
