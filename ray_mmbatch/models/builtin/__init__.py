"""The built-in model (pure PyTorch: vision tower, projector, decoder LM, varlen attention) and its backend.

Backend interface (see models/__init__.py): trained from scratch, so ``configure`` keeps the
data path's defaults and ``export`` writes a plain state dict with the config.
"""
from __future__ import annotations

from ray_mmbatch.models.builtin.attention import (
    BACKENDS,
    AttentionLayout,
    attend,
    pack_layout,
    pad_layout,
    resolve_backend,
)
from ray_mmbatch.models.builtin.vlm import VisionLanguageModel, batch_mode, build_model, count_parameters

NAME = "builtin"
MODEL_TYPES: tuple[str, ...] = ()


def configure(cfg):
    """Nothing to read: the built-in model takes the config as it is."""
    if cfg.model.path:
        raise ValueError("the builtin backend trains from scratch; it takes no model.path")
    return cfg


def create_model(cfg, ids: dict):
    """A fresh built-in model sized by cfg.model, for the tokenizer ids in ``ids``."""
    return build_model(cfg.model, cfg.image, vocab_size=ids["vocab_size"], image_token_id=ids["image_token_id"],
                       pad_id=ids["pad_id"])


def fsdp_units(model: VisionLanguageModel) -> list:
    """The decoder blocks (the vision blocks stay in the root unit: see vision_modules)."""
    return list(model.decoder.blocks)


def vision_modules(model: VisionLanguageModel) -> list:
    """The vision encoder (patch embedding, blocks, projector to the LM width): text-only batches skip it."""
    return [model.vision]


def state_prefix(model: VisionLanguageModel) -> str:
    """The whole state dict is the model's: no prefix."""
    return ""


def export(model, cfg, directory, state_dict=None) -> None:
    """model.pt (state dict; ``state_dict`` when given, e.g. gathered from FSDP shards) + config.yaml:
    what ``build_model`` needs to rebuild it."""
    from pathlib import Path

    import torch

    from ray_mmbatch.config import save_config

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict() if state_dict is None else state_dict, d / "model.pt")
    save_config(cfg, d / "config.yaml")


__all__ = [
    "BACKENDS", "AttentionLayout", "attend", "pack_layout", "pad_layout", "resolve_backend",
    "VisionLanguageModel", "batch_mode", "build_model", "count_parameters",
    "NAME", "MODEL_TYPES", "configure", "create_model", "fsdp_units", "vision_modules", "state_prefix", "export",
]
