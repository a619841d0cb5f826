"""Public API for Hugging Face checkpoints: the config a checkpoint implies, and its model.

    cfg = ray_mmbatch.hf.config_from_checkpoint("/ckpt/Qwen2.5-VL-3B-Instruct")
    model = ray_mmbatch.hf.load_model("/ckpt/Qwen2.5-VL-3B-Instruct")
    for batch in ray_mmbatch.local_batches(cfg, limit=2):
        ce_sum, n_target = model(batch, loss_only=True)

``load_model`` returns a ``torch.nn.Module`` with the built-in model's contract
(``forward(batch, loss_only=True) -> (ce_sum, n_target)`` on the dict a Train worker
receives, numpy as the iterators yield it or torch) and the transformers model as ``.hf_model``.
"""
from __future__ import annotations

from ray_mmbatch.config import Config


def config_from_checkpoint(path: str, cfg: Config | None = None) -> Config:
    """``cfg`` (default: a fresh Config) with model.path set and the checkpoint's image / text settings."""
    from ray_mmbatch.models import configure

    cfg = cfg if cfg is not None else Config()
    cfg.model.path = str(path)
    return configure(cfg)


def load_model(path: str, cfg: Config | None = None):
    """The checkpoint's model behind the project's forward contract (see module docstring)."""
    from ray_mmbatch.models import get_backend, token_ids

    cfg = config_from_checkpoint(path, cfg)
    return get_backend(cfg).create_model(cfg, token_ids(cfg))
