"""ray_mmbatch: token-budget batching of image-text data for multimodal training on Ray.

``local_batches(cfg, limit)`` yields the training batches in-process (no Ray);
``batch_by_token_budget(ds, max_tokens=...)`` plans any ``ray.data.Dataset`` into token-budget
batches (dataflow/operator.py); ``ray_mmbatch.hf`` loads Hugging Face checkpoints behind the
project's model contract. Both functions import their modules lazily: the package import stays light.
"""
from __future__ import annotations


def local_batches(cfg, limit=None, epoch=0, with_skips=False, shard=(0, 1), split="train"):
    """See ray_mmbatch.dataflow.local.local_batches (imported lazily: the package import stays light)."""
    from ray_mmbatch.dataflow.local import local_batches as _local_batches

    return _local_batches(cfg, limit=limit, epoch=epoch, with_skips=with_skips, shard=shard, split=split)


def batch_by_token_budget(ds, **kwargs):
    """See ray_mmbatch.dataflow.operator.batch_by_token_budget (imported lazily: the package import stays light)."""
    from ray_mmbatch.dataflow.operator import batch_by_token_budget as _batch_by_token_budget

    return _batch_by_token_budget(ds, **kwargs)


__all__ = ["batch_by_token_budget", "local_batches"]
