"""The LM head + cross-entropy of the target tokens, a bounded chunk of tokens at a time.

Every backend's loss (built-in and HF) is ``target_cross_entropy(head, hidden, labels)``: only target
positions go through the head (labels are already shifted), and their fp32 logits exist for at most
``chunk_tokens`` tokens at once, in the forward and in the backward::

    targets   h[0 .. C)        h[C .. 2C)      ...   h[(k-1)C .. N)
    forward   head -> fp32 [C, V] -> CE -> freed    (each chunk in turn; the CE kept, [C] or a sum)
    backward  the last chunk's saved logits first (it is not checkpointed: its backward comes first);
              then each other chunk recomputes its [C, V] logits (torch.utils.checkpoint, non-reentrant),
              backs them up, frees them

Without chunks the loss held [N, V] fp32 logits plus their log-softmax for the backward: on a 151,936-row
head, 4,473 targets grew a process by 7.9 GB and 16k would need ~28 GB (issue 43). With chunks the loss
needs about 3 x C x V x 4 bytes (logits, log-softmax, their gradient) whatever N is: C = 1024 and
V = 151,936 make 1.9 GB. The price is one more head matmul per chunk but the last (the recompute), about
a third of the head's forward + backward; benchmarks/bench_memory.py measures both sides, and
benchmarks/RESULTS.md ("Memory") holds the figures.

``head`` is called as a module (``lm_head(h)``), never through its weight, so a wrapped head (LoRA's
modules_to_save, FSDP2's root unit, bf16 autocast) computes as it does unchunked; non-reentrant checkpointing
restores the autocast state for the recompute and keeps the original graph's edges to the parameters
(DDP's hooks and FSDP2's root unit see one backward per parameter). Per-token values equal the unchunked
formula's, in the same order; a 'sum' adds the chunks' sums (fp32 round-off only).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ray_mmbatch.schema import IGNORE_INDEX

LOSS_CHUNK_TOKENS = 1024
"""Target tokens whose fp32 logits exist at once (forward and backward); the memory estimate
(train/memory.py) reads it."""


def _chunk_ce(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: torch.Tensor,
              reduction: str) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, reduction=reduction)  # fp32 CE even under autocast


def target_cross_entropy(head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, labels: torch.Tensor,
                         reduction: str = "sum", chunk_tokens: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """fp32 CE of the positions whose label is not IGNORE_INDEX: 'sum' (a scalar) or 'none' (one value per target,
    row-major over ``labels``); ``head(hidden[targets]) -> logits`` runs on at most ``chunk_tokens`` rows at once."""
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction must be 'sum' or 'none', got {reduction!r}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    is_target = labels != IGNORE_INDEX
    h, y = hidden[is_target], labels[is_target].long()
    starts = range(0, h.shape[0], chunk_tokens)
    if len(starts) <= 1:  # one chunk: exactly the unchunked graph (an empty one keeps the head in it too)
        return _chunk_ce(head, h, y, reduction)
    recompute = torch.is_grad_enabled()
    parts = []
    for i, s in enumerate(starts):
        hs, ys = h[s:s + chunk_tokens], y[s:s + chunk_tokens]
        if recompute and i < len(starts) - 1:
            parts.append(checkpoint(_chunk_ce, head, hs, ys, reduction, use_reentrant=False))
        else:
            parts.append(_chunk_ce(head, hs, ys, reduction))
    return torch.cat(parts) if reduction == "none" else torch.stack(parts).sum()
