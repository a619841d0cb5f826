"""One optimizer step over several micro-batches, with the loss normalized right.

The loss of an optimizer step is the mean CE over ALL target tokens of that
step, across every micro-batch and every data-parallel rank::

    N      = all_reduce_sum( sum over my micro-batches of n_target )   (before any backward)
    loss_i = ce_sum_i * world_size / N                                 (micro-batch i)

so the accumulated, DDP-averaged gradient is  (1/world) * sum_ranks sum_i
grad(ce_sum_i) * world / N = grad(sum of all CE) / N. Averaging per micro-batch
(mean CE of each, divided by the number of micro-batches) would weight a token
in a 10-target micro-batch 10x more than one in a 100-target micro-batch.

DDP's all-reduce runs only on the last micro-batch (``no_sync`` on the others).
Autocast: bf16 on CUDA by default, opt-in on CPU; the CE itself is fp32.
No Ray here: the Ray Train loop (train/loop.py) calls ``optimizer_step``.
"""
from __future__ import annotations

import contextlib
import math
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from ray_mmbatch.config import TrainConfig
from ray_mmbatch.models.inputs import batch_to_torch  # noqa: F401 (the train step's callers import it here)
from ray_mmbatch.schema import IGNORE_INDEX

PRECISIONS = ("auto", "bf16", "fp32")

def count_targets(batch: dict) -> int:
    """Target tokens of a batch (numpy or torch), counted from its labels."""
    labels = batch["labels"]
    return int((labels != IGNORE_INDEX).sum())


def token_loss_sum(model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of fp32 CE over target tokens, number of target tokens) for one batch."""
    return model(batch, loss_only=True)


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """None = run in fp32; 'auto' = bf16 on CUDA, fp32 elsewhere."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce(values: list[float], device: torch.device | str, op: str = "sum") -> list[float]:
    """Sum (or max) of ``values`` over the ranks; the one collective helper of the train path.

    NCCL reduces only CUDA tensors and gloo only CPU ones, so the tensor is made where the
    process group's backend wants it (the training device under NCCL).
    """
    if _world() == 1:
        return list(values)
    where = torch.device(device) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
    return t.tolist()


class Lockstep:
    """Ranks step together until none has data: the one rule of the training loop, ``ingest``
    and evaluation. Every step each rank calls ``join(batch or None)`` (one all-reduce): when
    no rank has a batch left, all get None and stop at the same step; a rank that ran dry
    steps on a zero-target copy of its last batch (no loss, no gradient), so DDP's gradient
    all-reduce and FSDP2's all-gathers still see every rank. A rank that never had a batch
    steps on ``filler_batch`` with the patch size of the model: ``patch_dim`` when the caller
    knows it (one sum all-reduce, with ``sums`` riding along), else the largest any rank has
    seen (a max all-reduce; ``sums`` then take a second one).
    """

    def __init__(self, device: torch.device | str, patch_dim: int = 0):
        self.device, self.known = device, int(patch_dim) > 0
        self.patch_dim, self.last = int(patch_dim), None

    def join(self, batch: dict | None, sums: list[float] = ()) -> tuple[dict | None, list[float]]:
        """(the batch this rank steps on, or None when no rank has one; ``sums`` summed over the ranks)."""
        from ray_mmbatch.batching.layout import filler_batch, zero_target

        if batch is not None:
            self.last = batch
            if not self.known:
                self.patch_dim = max(self.patch_dim, int(np.asarray(batch["patches"]).shape[1]))
        if self.known:
            has, *total = all_reduce([float(batch is not None), *map(float, sums)], self.device)
        else:
            has, dim = all_reduce([float(batch is not None), float(self.patch_dim)], self.device, op="max")
            self.patch_dim = int(dim)
            total = all_reduce([float(x) for x in sums], self.device) if len(sums) else []
        if not has:
            return None, total
        if batch is None:  # ran dry: a step with no targets joins the others' collectives
            batch = zero_target(self.last if self.last is not None else filler_batch(self.patch_dim))
        return batch, total


def accumulate_gradients(model: nn.Module, micro_batches: list[dict], device: torch.device | str,
                         dtype: torch.dtype | None = None) -> dict:
    """Forward + backward every micro-batch of one optimizer step; grads are left in ``.grad``.

    ``micro_batches`` are numpy dicts (converted one at a time, so only one is
    on the device at once) or already-converted torch dicts. Returns the
    global loss (mean over all targets), counts and the local real tokens.
    """
    device = torch.device(device)
    if not micro_batches:
        raise ValueError("an optimizer step needs at least one micro-batch")
    local_targets = sum(count_targets(b) for b in micro_batches)
    world = _world()
    (global_targets,) = all_reduce([float(local_targets)], device)
    scale = world / max(global_targets, 1.0)
    ddp = isinstance(model, nn.parallel.DistributedDataParallel)
    local_ce = 0.0
    real_tokens = 0
    for i, batch in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        sync = contextlib.nullcontext() if last or not ddp else model.no_sync()
        tb = batch_to_torch(batch, device) if isinstance(batch["labels"], np.ndarray) else batch
        with sync:
            with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                ce_sum, _ = token_loss_sum(model, tb)
            (ce_sum * scale).backward()
        local_ce += float(ce_sum.detach())
        real_tokens += int(batch["real_tokens"])  # collate's count (mask_samples keeps it right)
    (global_ce,) = all_reduce([local_ce], device)
    return {"loss": global_ce / max(global_targets, 1.0), "n_target": int(global_targets),
            "local_n_target": local_targets, "real_tokens": real_tokens, "world_size": world}


def optimizer_step(model: nn.Module, micro_batches: list[dict], optimizer: torch.optim.Optimizer, scheduler,
                   train_cfg: TrainConfig, device: torch.device | str) -> dict:
    """One optimizer step: accumulate, clip (``grad_clip``), step optimizer and scheduler, zero grads.

    Returns the metrics of ``accumulate_gradients`` plus ``lr`` (used this
    step), ``grad_norm`` (before clipping), ``time_s`` and ``tokens_per_s``.
    """
    device = torch.device(device)
    start = time.perf_counter()
    model.train()
    metrics = accumulate_gradients(model, micro_batches, device, autocast_dtype(train_cfg.precision, device))
    params = [p for p in model.parameters() if p.grad is not None]
    max_norm = train_cfg.grad_clip if train_cfg.grad_clip > 0 else float("inf")
    metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    metrics["lr"] = optimizer.param_groups[0]["lr"]
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    metrics["time_s"] = time.perf_counter() - start
    metrics["tokens_per_s"] = metrics["real_tokens"] / max(metrics["time_s"], 1e-9)
    return metrics


def lr_lambda(step: int, warmup_steps: int, total_steps: int, floor: float = 0.1) -> float:
    """Linear warm-up to 1, then cosine decay to ``floor`` at ``total_steps``."""
    return lr_by_progress(step, warmup_steps, (step - warmup_steps) / max(1, total_steps - warmup_steps), floor)


def lr_by_progress(step: int, warmup_steps: int, progress: float, floor: float = 0.1,
                   warmup_share: float = 0.0) -> float:
    """Linear warm-up to 1 by steps, then cosine decay to ``floor`` as ``progress`` goes 0 -> 1.

    For runs that go by epochs (no max_steps): the number of steps is not known before the
    batches are planned, so the schedule follows the share of the planned samples done.
    ``warmup_share`` (train.warmup_ratio, with no warmup_steps): the warm-up is the first share
    of the samples instead (from 0, as HF's warm-up starts), and the cosine spans the rest.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    p = min(1.0, max(0.0, progress))
    if not warmup_steps and warmup_share > 0:
        if p < warmup_share:
            return p / warmup_share
        p = (p - warmup_share) / max(1e-9, 1.0 - warmup_share)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * p))


class Progress:
    """Share of the run done (0..1), set by the train loop, read by the learning-rate schedule."""

    def __init__(self, value: float = 0.0):
        self.value = value


def build_optimizer(model: nn.Module, train_cfg: TrainConfig, total_steps: int, progress: Progress | None = None):
    """AdamW with no weight decay on norms and biases (1-D params) + warm-up/cosine LambdaLR:
    cosine over ``total_steps``, or over ``progress`` when given (see lr_by_progress)."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=train_cfg.lr, betas=(0.9, 0.95))
    total, share = max(1, total_steps), train_cfg.warmup_ratio or 0.0
    # warmup_steps wins; else warmup_ratio of the steps, or (by epochs) of the samples (lr_by_progress)
    warmup = train_cfg.warmup_steps or (math.ceil(share * total) if progress is None else 0)
    if progress is not None:
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_by_progress(s, warmup, progress.value, warmup_share=share))
    else:
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, warmup, total))
    return optimizer, scheduler
