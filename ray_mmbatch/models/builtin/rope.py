"""Rotary position embeddings: 1-D for the language model, 2-D for image patches.

The LM takes its positions from the batch's ``position_ids`` (restarting at 0
per packed sample), so a packed sample is rotated exactly as if it were alone.

Image patches arrive in Qwen2-VL merge-window order (for each m x m merge block,
row-major over blocks, its patches row-major). ``patch_positions`` recomputes
each patch's (row, col) in that order from the grid; 2-D RoPE then rotates the
first half of every head by the row and the second half by the column.
Cost: O(tokens * head_dim) elementwise per layer, nothing learned.
"""
from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [...] -> cos, sin [..., dim] in the rotate-half layout (fp32)."""
    if dim % 2:
        raise ValueError(f"rotary dim must be even, got {dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, L, D]; cos/sin broadcastable to it. Computed in fp32, returned in x's dtype."""
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).to(x.dtype)


def apply_rope_2d(x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor],
                  cols: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """First half of the head dim rotated by the row position, second half by the column."""
    half = x.shape[-1] // 2
    return torch.cat([apply_rope(x[..., :half], *rows), apply_rope(x[..., half:], *cols)], dim=-1)


def patch_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch, [P, 2] long, images concatenated, in merge-window order."""
    out = []
    for t, gh, gw in grid_thw.tolist():
        if t != 1 or gh % merge or gw % merge or gh <= 0 or gw <= 0:
            raise ValueError(f"image grid (t={t}, h={gh}, w={gw}) must have t == 1 and h, w "
                             f"positive multiples of merge_size={merge}")
        shape = (gh // merge, merge, gw // merge, merge)        # (bh, i, bw, j)
        rows = torch.arange(gh).view(gh // merge, merge, 1, 1).expand(shape)
        cols = torch.arange(gw).view(1, 1, gw // merge, merge).expand(shape)
        # merge-window order is (bh, bw, i, j)
        pos = torch.stack([rows.permute(0, 2, 1, 3).reshape(-1), cols.permute(0, 2, 1, 3).reshape(-1)], -1)
        out.append(pos)
    if not out:
        return torch.zeros(0, 2, dtype=torch.long, device=grid_thw.device)
    return torch.cat(out).to(grid_thw.device)
