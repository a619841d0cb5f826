"""ray_mmbatch: token-budget batching of image-text data for multimodal training on Ray.

``local_batches(cfg, limit)`` yields the training batches in-process (no Ray);
``ray_mmbatch.hf`` loads Hugging Face checkpoints behind the project's model contract.
"""
from __future__ import annotations


def local_batches(cfg, limit=None, epoch=0, with_skips=False):
    """See ray_mmbatch.dataflow.local.local_batches (imported lazily: the package import stays light)."""
    from ray_mmbatch.dataflow.local import local_batches as _local_batches

    return _local_batches(cfg, limit=limit, epoch=epoch, with_skips=with_skips)


__all__ = ["local_batches"]
