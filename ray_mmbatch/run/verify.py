"""Is packing exact for this model? Per-token loss of packed / padded batches vs each sample alone.

For every batch: the CE of every target token when the batch runs as planned (pack: one
sequence, attention isolated per sample; pad: rows padded to the longest), and the CE of the
same tokens when each sample runs alone (one unpadded row; for HF backends that is HF's own
standard path: input_ids + attention_mask, the model building its own positions). The largest
absolute difference is the figure: about 1e-5 in fp32 when packing is exact, nats when attention
leaks across samples or positions are wrong. Pure torch, no Ray: ``jobs/verify_packing.py``
runs it on ``local_batches``.

With ``grads``, the gradients too: of the summed target CE of the batch as planned, and of the
same sum over each sample alone, over the parameters that train (``requires_grad``: a LoRA run's
adapter weights, the parts ``--freeze`` leaves). The figure is the relative difference
``||g_planned - g_alone|| / ||g_alone||`` per batch, about 1e-6 in fp32 when packing is exact. The
command turns it on when the model carries LoRA adapters (few weights: two more copies of their
gradients cost nothing); on a full model it costs two copies of the weights' size.
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
DEFAULT_GRAD_TOLERANCE = {"fp32": 1e-4, "bf16": 0.05}  # ||g_planned - g_alone|| / ||g_alone|| per batch


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


def _grads(model, batches: list[dict], params: list[torch.nn.Parameter], device, dtype) -> list[torch.Tensor]:
    """Gradient of the summed target CE over ``batches`` (numpy), for each of ``params``."""
    for p in params:
        p.grad = None
    with torch.enable_grad(), torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        for b in batches:
            ce_sum, _ = model(batch_to_torch(b, device), loss_only=True)
            ce_sum.backward()
    out = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return out


def compare_grads(model, batch: dict[str, Any], pad_id: int, device, dtype=None,
                  params: list[torch.nn.Parameter] | None = None) -> tuple[float, float]:
    """(||g_planned - g_alone||, ||g_alone||) over ``params`` (default: those with requires_grad)."""
    device = torch.device(device)
    params = [p for p in model.parameters() if p.requires_grad] if params is None else params
    planned = _grads(model, [batch], params, device, dtype)
    alone = _grads(model, [collate_pad([s], pad_id) for s in split_batch(batch)], params, device, dtype)
    diff = sum(float(((a.double() - b.double()) ** 2).sum()) for a, b in zip(planned, alone))
    norm = sum(float((b.double() ** 2).sum()) for b in alone)
    return diff ** 0.5, norm ** 0.5


def verify(model, batches: Iterable[dict[str, Any]], pad_id: int, device="cpu", precision: str = "fp32",
           tolerance: float | None = None, grads: bool = False,
           grad_tolerance: float | None = None) -> dict[str, Any]:
    """Run every batch both ways; a JSON-able report with ``ok`` = max difference <= tolerance
    (with ``grads``: and the gradients' relative difference <= grad_tolerance, under ``grads``)."""
    device = torch.device(device)
    dtype = autocast_dtype(precision, device)
    prec = "bf16" if dtype is not None else "fp32"
    tol = DEFAULT_TOLERANCE[prec] if tolerance is None else tolerance
    params = [p for p in model.parameters() if p.requires_grad] if grads else []
    if grads and not params:
        raise ValueError("grads: no parameter of the model requires grad")
    model.eval()  # no dropout (LoRA's included): both ways must see the same function
    diffs, rel, norms, n_batches, n_samples, modes = [], [], [], 0, 0, set()
    for batch in batches:
        diffs.append(compare_batch(model, batch, pad_id, device, dtype))
        if params:
            diff, norm = compare_grads(model, batch, pad_id, device, dtype, params)
            rel.append(diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf")))
            norms.append(norm)
        n_batches += 1
        n_samples += len(batch["sample_ids"])
        modes.add(str(batch["mode"]))
    d = np.concatenate(diffs) if diffs else np.zeros(0)
    worst = float(d.max()) if d.size else 0.0
    report = {"ok": bool(d.size) and worst <= tol, "max_abs_diff": worst,
              "mean_abs_diff": float(d.mean()) if d.size else 0.0, "target_tokens": int(d.size),
              "batches": n_batches, "samples": n_samples, "mode": sorted(modes),
              "precision": prec, "tolerance": tol}
    if params:
        gtol = DEFAULT_GRAD_TOLERANCE[prec] if grad_tolerance is None else grad_tolerance
        g_ok = bool(rel) and max(rel) <= gtol
        report["grads"] = {"ok": g_ok, "max_rel_diff": max(rel, default=0.0), "tolerance": gtol,
                           "params": len(params), "elements": sum(p.numel() for p in params),
                           "min_norm": min(norms, default=0.0)}
        report["ok"] = report["ok"] and g_ok
    return report
