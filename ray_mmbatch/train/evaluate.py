"""The held-out loss (``--eval-split`` / ``--eval-data``), on every rank in parallel.

Each rank reads its share of the held-out set's read units (``local_batches(shard=(rank,
world), split="eval")``: units rank, rank + world, ...; every held-out sample on exactly one
rank), plans and collates it with the run's own budget and mode (pack included) in its own
process, and sums the token CE of every target; the eval loss is the sum over all ranks over
the count of all target tokens: the mean over every target token of the set, which packing
does not change (tests/test_evaluate.py checks it against each sample run alone). No Ray Data
stream: the eval set is read again at every evaluation without actors or a split coordinator,
so an evaluation can never stall the training stream. Ranks run the same number of forward
passes (a rank that ran out takes zero-target copies: FSDP2's all-gathers need every rank).
"""
from __future__ import annotations

from typing import Any

import torch


def evaluate(model, cfg, rank: int, world: int, device, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """{"eval_loss", "eval_target_tokens", "eval_samples", "ids"} (ids: this rank's samples)."""
    from ray_mmbatch.batching.layout import filler_batch, patch_dim, zero_target
    from ray_mmbatch.dataflow.local import local_batches
    from ray_mmbatch.models.inputs import batch_to_torch
    from ray_mmbatch.train.step import all_reduce

    device = torch.device(device)
    bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    batches = local_batches(cfg, shard=(rank, world), split="eval")
    ce, targets, ids, last = 0.0, 0, [], None
    was_training = bare.training
    bare.eval()
    try:
        with torch.no_grad():
            while True:
                batch = next(batches, None)
                (has,) = all_reduce([float(batch is not None)], device, op="max")
                if not has:
                    break
                if batch is None:  # this rank is done: a pass with no targets keeps FSDP's collectives even
                    batch = zero_target(last or filler_batch(patch_dim(cfg.image)))
                else:
                    last = batch
                    ids += [str(s) for s in batch["sample_ids"]]
                with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    ce_sum, n_target = bare(batch_to_torch(batch, device), loss_only=True)
                ce += float(ce_sum)
                targets += int(n_target)
    finally:
        bare.train(was_training)
    total_ce, total_targets, n = all_reduce([ce, float(targets), float(len(ids))], device)
    return {"eval_loss": total_ce / total_targets if total_targets else float("nan"),
            "eval_target_tokens": int(total_targets), "eval_samples": int(n), "ids": ids}
