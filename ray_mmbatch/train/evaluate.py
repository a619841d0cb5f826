"""The held-out loss (``--eval-split`` / ``--eval-data``), on every rank in parallel.

Each rank reads its share of the held-out set's read units (``local_batches(shard=(rank,
world), split="eval")``: units rank, rank + world, ...; every held-out sample on exactly one
rank), plans and collates it with the run's own budget and mode (pack included) in its own
process, and sums the token CE of every target; the eval loss is the sum over all ranks over
the count of all target tokens: the mean over every target token of the set, which packing
does not change (tests/test_evaluate.py checks it against each sample run alone). No Ray Data
stream: the eval set is read in-process without actors or a split coordinator, so an evaluation
can never stall the training stream; ``EvalCache`` keeps a rank's collated batches after the first
evaluation (up to ``train.eval_cache_mb``), so later ones only run the forward passes. Ranks
run the same number of forward passes (a rank that ran out takes zero-target copies: FSDP2's
all-gathers need every rank; train/step.Lockstep).
"""
from __future__ import annotations

from typing import Any

import torch


class EvalCache:
    """A rank's held-out batches, kept after the first full pass while they fit in ``cap_mb``
    (numpy arrays' bytes); past the cap the pass goes on reading and the next one reads again."""

    def __init__(self, cap_mb: float):
        self.cap = float(cap_mb) * 2**20
        self.batches: list[dict] | None = None  # a complete pass, or None
        self.passes = self.reads = 0

    def iterate(self, read) -> Any:
        """The batches of one evaluation: the kept ones, or ``read()``'s (kept if the whole pass fits)."""
        import numpy as np

        self.passes += 1
        if self.batches is not None:
            yield from self.batches
            return
        self.reads += 1
        kept: list[dict] | None = [] if self.cap > 0 else None
        size = 0
        for batch in read():
            if kept is not None:
                size += sum(v.nbytes for v in batch.values() if isinstance(v, np.ndarray))
                if size <= self.cap:
                    kept.append(batch)
                else:
                    kept = None
            yield batch
        self.batches = kept


def evaluate(model, cfg, rank: int, world: int, device, dtype: torch.dtype | None = None,
             cache: EvalCache | None = None) -> dict[str, Any]:
    """{"eval_loss", "eval_target_tokens", "eval_samples", "ids"} (ids: this rank's samples).
    ``cache``: keep this rank's batches for the next evaluation (EvalCache)."""
    from ray_mmbatch.batching.layout import patch_dim
    from ray_mmbatch.dataflow.local import local_batches
    from ray_mmbatch.models.inputs import batch_to_torch
    from ray_mmbatch.train.step import Lockstep, all_reduce

    device = torch.device(device)
    bare = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    def read():
        return local_batches(cfg, shard=(rank, world), split="eval")

    batches = iter(cache.iterate(read) if cache is not None else read())
    lockstep = Lockstep(device, patch_dim(cfg.image))  # a rank that is done: passes with no targets
    ce, targets, ids = 0.0, 0, []
    was_training = bare.training
    bare.eval()
    try:
        with torch.no_grad():
            while True:
                mine = next(batches, None)
                batch, _ = lockstep.join(mine)
                if batch is None:
                    break
                if mine is not None:
                    ids += [str(s) for s in mine["sample_ids"]]
                with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    ce_sum, n_target = bare(batch_to_torch(batch, device), loss_only=True)
                ce += float(ce_sum)
                targets += int(n_target)
    finally:
        bare.train(was_training)
    total_ce, total_targets, n = all_reduce([ce, float(targets), float(len(ids))], device)
    return {"eval_loss": total_ce / total_targets if total_targets else float("nan"),
            "eval_target_tokens": int(total_targets), "eval_samples": int(n), "ids": ids}
