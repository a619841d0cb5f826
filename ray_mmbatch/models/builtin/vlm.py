"""The vision-language model: vision tower + projector spliced into a decoder LM.

Forward over one batch (see batching/collate.py for the layout)::

    input_ids [B, T] --embed--> x [B, T, d]
    patches, image_grid_thw, vision_cu_seqlens --VisionEncoder--> feats [N_img_tokens, d]
    x[input_ids == image_token_id] = feats     (row-major over the batch = image order)
    Decoder(x, position_ids, layout) -> hidden [B, T, d]
    tied head: logits = hidden @ embed.weight.T

``mode == "pack"``: B == 1, layout = block-diagonal causal from ``cu_seqlens``.
``mode == "pad"``:  layout = causal + key padding from ``attention_mask``.

``forward(batch, loss_only=True)`` returns ``(ce_sum fp32, n_target)`` and
projects only the target positions through the head, a bounded chunk at a time
(models/loss.py), so a 4096-token pack never materializes [T, V] logits (labels
are already shifted: labels[t] is the target of position t).

Size: set by ModelConfig and the tokenizer's vocabulary (``build_model``). Packed
attention runs per group of similar-length samples (models/builtin/attention.py),
so a pack costs about sum(L_i^2), not T^2: training throughput is in
benchmarks/RESULTS.md ("Training throughput").
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ray_mmbatch.config import ImageConfig, ModelConfig
from ray_mmbatch.models.builtin.attention import BACKENDS, pack_layout, pad_layout
from ray_mmbatch.models.builtin.decoder import Decoder
from ray_mmbatch.models.builtin.layers import init_weights
from ray_mmbatch.models.builtin.vision import VisionEncoder
from ray_mmbatch.models.inputs import as_torch
from ray_mmbatch.models.loss import LOSS_CHUNK_TOKENS, target_cross_entropy
from ray_mmbatch.schema import IGNORE_INDEX

MODES = ("pack", "pad")


def batch_mode(batch: dict) -> str:
    """The batch's mode as a plain str, whatever container the decoder handed over."""
    mode = batch.get("mode")
    if isinstance(mode, np.ndarray):
        mode = mode.reshape(-1)[0] if mode.size == 1 else mode
    if isinstance(mode, (bytes, np.bytes_)):
        mode = mode.decode()
    mode = str(mode) if isinstance(mode, (str, np.str_)) else mode
    if mode not in MODES:
        raise ValueError(f"batch['mode'] must be one of {MODES}, got {mode!r}")
    return mode


class VisionLanguageModel(nn.Module):
    backend_name = "builtin"  # the models/ registry entry that builds it (models.backend_of)

    def __init__(self, model_cfg: ModelConfig, image_cfg: ImageConfig, vocab_size: int,
                 image_token_id: int, pad_id: int):
        super().__init__()
        if not 0 <= image_token_id < vocab_size or not 0 <= pad_id < vocab_size:
            raise ValueError(f"image_token_id={image_token_id} and pad_id={pad_id} must be < vocab_size={vocab_size}")
        if model_cfg.attention not in BACKENDS:     # fail at build time, not on the first batch
            raise ValueError(f"unknown attention backend {model_cfg.attention!r}; choose one of {BACKENDS}")
        self.vocab_size, self.image_token_id, self.pad_id = vocab_size, image_token_id, pad_id
        self.attention = model_cfg.attention
        self.loss_chunk_tokens = LOSS_CHUNK_TOKENS
        d = model_cfg.d_model
        self.embed = nn.Embedding(vocab_size, d)
        self.vision = VisionEncoder(image_cfg.patch_size, image_cfg.merge_size, model_cfg.vision_d_model,
                                    model_cfg.vision_layers, model_cfg.vision_heads, model_cfg.mlp_ratio,
                                    d, model_cfg.rope_theta, model_cfg.attention)
        self.decoder = Decoder(d, model_cfg.n_layers, model_cfg.n_heads, model_cfg.mlp_ratio, model_cfg.rope_theta)
        init_weights(self)

    # ------------------------------------------------------------------ forward
    def forward(self, batch: dict, loss_only: bool = False):
        """Logits [B, T, V], or with ``loss_only`` (ce_sum fp32 scalar, n_target int64 scalar).

        Going through ``forward`` (not a side method) matters under DDP: only
        ``forward`` arms the gradient all-reduce hooks.
        """
        batch = as_torch(batch, self)  # a batch as local_batches / Ray Data yield it works as is
        hidden = self.hidden_states(batch)
        if loss_only:
            return self.target_loss_sum(hidden, batch["labels"])
        return self.head(hidden)

    def hidden_states(self, batch: dict) -> torch.Tensor:
        mode = batch_mode(batch)
        ids = batch["input_ids"]
        if ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got {tuple(ids.shape)}")
        x = self._splice_images(self.embed(ids), ids, batch)
        if mode == "pack":
            if ids.shape[0] != 1:
                raise ValueError(f"pack mode expects input_ids [1, T], got {tuple(ids.shape)}")
            layout = pack_layout(batch["cu_seqlens"], ids.shape[1], causal=True, backend=self.attention,
                                 device=ids.device)
        else:
            layout = pad_layout(batch["attention_mask"], causal=True, backend=self.attention)
        return self.decoder(x, batch["position_ids"], layout)

    def image_features(self, batch: dict) -> torch.Tensor:
        """Projected features, one row per image token, images in batch order."""
        return self.vision(batch["patches"], batch["image_grid_thw"], batch["vision_cu_seqlens"])

    def target_loss_sum(self, hidden: torch.Tensor, labels: torch.Tensor):
        """(fp32 CE sum of the targets, their count); the tied head's logits of at most ``loss_chunk_tokens``
        targets at once (models/loss.py)."""
        ce_sum = target_cross_entropy(self.head, hidden, labels, "sum", self.loss_chunk_tokens)
        return ce_sum, (labels != IGNORE_INDEX).sum()

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The tied LM head: logits = hidden @ embed.weight.T."""
        return F.linear(hidden, self.embed.weight)

    def _splice_images(self, x: torch.Tensor, ids: torch.Tensor, batch: dict) -> torch.Tensor:
        is_image = ids == self.image_token_id
        n_slots = int(is_image.sum())
        patches = batch.get("patches")
        n_patches = 0 if patches is None else patches.shape[0]
        if n_patches == 0:
            if n_slots:
                raise ValueError(f"input_ids has {n_slots} image tokens but the batch has no patches")
            if torch.is_grad_enabled():
                # Keep the vision tower in the graph with zero gradient so DDP's
                # reducer sees every parameter on every rank, images or not.
                x = x + 0.0 * sum(p.sum() for p in self.vision.parameters())
            return x
        feats = self.image_features(batch)
        if feats.shape[0] != n_slots:
            raise ValueError(f"input_ids has {n_slots} image tokens ({self.image_token_id}) but the images "
                             f"give {feats.shape[0]} (= patches / merge_size^2)")
        return x.masked_scatter(is_image[..., None], feats.to(x.dtype))


def build_model(model_cfg: ModelConfig, image_cfg: ImageConfig, vocab_size: int, image_token_id: int,
                pad_id: int, seed: int | None = None) -> VisionLanguageModel:
    """A fresh model; ``model_cfg.vocab_size`` (if > 0) overrides the tokenizer's size."""
    vocab = model_cfg.vocab_size or vocab_size
    if vocab < vocab_size:
        raise ValueError(f"model vocab_size={vocab} is smaller than the tokenizer's {vocab_size}")
    if seed is not None:
        torch.manual_seed(seed)
    return VisionLanguageModel(model_cfg, image_cfg, vocab, image_token_id, pad_id)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
