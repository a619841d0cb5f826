"""Pure-PyTorch multimodal model: vision tower, projector, decoder LM, varlen attention."""
from ray_mmbatch.model.attention import BACKENDS, AttentionLayout, attend, pack_layout, pad_layout, resolve_backend
from ray_mmbatch.model.vlm import VisionLanguageModel, batch_mode, build_model, count_parameters

__all__ = [
    "BACKENDS", "AttentionLayout", "attend", "pack_layout", "pad_layout", "resolve_backend",
    "VisionLanguageModel", "batch_mode", "build_model", "count_parameters",
]
