"""Is packing exact for this model? Per-token loss of packed / padded batches vs each sample alone.

For every batch: the CE of every target token when the batch runs as planned (pack: one
sequence, attention isolated per sample; pad: rows padded to the longest), and the CE of the
same tokens when each sample runs alone (one unpadded row; for HF backends that is HF's own
standard path: input_ids + attention_mask, the model building its own positions). The largest
absolute difference is the figure: about 1e-5 in fp32 when packing is exact, nats when attention
leaks across samples or positions are wrong. Pure torch, no Ray: ``jobs/verify_packing.py``
runs it on ``local_batches``.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ray_mmbatch.batching.collate import collate_pad
from ray_mmbatch.batching.layout import split_batch
from ray_mmbatch.schema import IGNORE_INDEX
from ray_mmbatch.train.step import autocast_dtype, batch_to_torch

DEFAULT_TOLERANCE = {"fp32": 1e-4, "bf16": 0.05}  # per-token nats; bf16 rounding alone moves CE by ~2e-3 (CPU)


@torch.no_grad()
def target_ce(model, batch: dict) -> torch.Tensor:
    """fp32 CE of every target token of a (torch) batch, in sequence order."""
    if hasattr(model, "target_ce"):
        return model.target_ce(batch).float()
    logits = model(batch)
    labels = batch["labels"]
    is_target = labels != IGNORE_INDEX
    return F.cross_entropy(logits[is_target].float(), labels[is_target].long(), reduction="none")


def compare_batch(model, batch: dict[str, Any], pad_id: int, device, dtype=None) -> np.ndarray:
    """|CE(batch as planned) - CE(each sample alone)| per target token (numpy batch in)."""
    device = torch.device(device)
    with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        planned = target_ce(model, batch_to_torch(batch, device))
        alone = [target_ce(model, batch_to_torch(collate_pad([s], pad_id), device)) for s in split_batch(batch)]
    alone_cat = torch.cat(alone) if alone else planned[:0]
    if alone_cat.shape != planned.shape:
        raise AssertionError(f"{planned.numel()} target tokens planned but {alone_cat.numel()} alone")
    return (planned - alone_cat).abs().cpu().numpy()


def verify(model, batches: Iterable[dict[str, Any]], pad_id: int, device="cpu", precision: str = "fp32",
           tolerance: float | None = None) -> dict[str, Any]:
    """Run every batch both ways; a JSON-able report with ``ok`` = max difference <= tolerance."""
    device = torch.device(device)
    dtype = autocast_dtype(precision, device)
    tol = DEFAULT_TOLERANCE["bf16" if dtype is not None else "fp32"] if tolerance is None else tolerance
    model.eval()
    diffs, n_batches, n_samples, modes = [], 0, 0, set()
    for batch in batches:
        diffs.append(compare_batch(model, batch, pad_id, device, dtype))
        n_batches += 1
        n_samples += len(batch["sample_ids"])
        modes.add(str(batch["mode"]))
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    worst = float(d.max()) if d.size else 0.0
    return {"ok": bool(d.size) and worst <= tol, "max_abs_diff": worst,
            "mean_abs_diff": float(d.mean()) if d.size else 0.0, "target_tokens": int(d.size),
            "batches": n_batches, "samples": n_samples, "mode": sorted(modes),
            "precision": "bf16" if dtype is not None else "fp32", "tolerance": tol}
