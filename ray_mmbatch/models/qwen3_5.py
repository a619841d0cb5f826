"""Qwen3.5 backend (``qwen3_5`` dense, ``qwen3_5_moe``): checkpoint settings, the exact packed forward, export.

Qwen3.5 is Qwen3-VL's vision side (16-pixel patches, 2 x 2 merge, a learned position grid, the Qwen2-VL image
processor's smart resize) in front of a hybrid language model: Gated DeltaNet (linear attention) layers
interleaved with gated full-attention layers (3 of every 4 layers linear in the published checkpoints), with
interleaved M-RoPE over a quarter of each head. A packed batch is exact (tests/test_models_qwen3_5.py, against
each sample alone through HF's forward) when:

- the full-attention layers get what Qwen-VL's get (models/qwen_vl.py, the same adapter): row 0 of the
  [4, 1, T] position ids restarting per sample (HF's block-diagonal mask; flash attention: the explicit
  varlen kwargs) and rows 1-3 each sample's own ``get_rope_index``;
- every Gated DeltaNet layer starts each sample from a zero recurrent state and an empty conv window
  (models/deltanet.py): the adapter adds the row's cu_seqlens as ``deltanet.SEGMENTS``. HF's own packed forward
  does not do this without the fla and causal-conv1d kernels (its torch fallbacks ignore the boundaries).

Video is Qwen3-VL's: the Qwen/Qwen3.5-* repos ship Qwen3-VL's processors (Qwen3VLVideoProcessor,
Qwen3VLProcessor) and HF's Qwen3.5 model takes ``pixel_values_videos`` / ``video_grid_thw`` with Qwen3-VL's layout
(each frame its timestamp text and its own vision block; ``get_rope_index`` splits the grid per frame). configure
takes Qwen3-VL's video settings (qwen_vl._configure_video: image.video 'qwen3_vl', the --video-* flags honoured),
and the adapter feeds clips as Qwen-VL's does (``mm_token_type_ids`` 2 at video tokens, each packed sample's
M-RoPE ids from its own images and videos); the DeltaNet segments cover a clip's tokens as any other.

Padded batches (right padding) are HF's own path: attention_mask + mm_token_type_ids; the DeltaNet layers are
causal, so the padding after a sample changes nothing before it.

MoE (``qwen3_5_moe``): the loss is the cross-entropy only. The router's load-balancing loss (HF adds
``router_aux_loss_coef`` x it only with ``output_router_logits``, which this backend leaves off) is not added,
packed or padded: a packed row would count the balance over all its samples' tokens together, a padded batch
over rows with their padding masked, so neither would equal the per-sample sum, and exactness is stated on
the CE. Train the router with the CE (or add the aux loss in your own loop, knowing it is per batch).

Cost: that of Qwen-VL's adapter (one ``get_rope_index`` per packed sample with images or videos) plus the DeltaNet
segments (models/deltanet.py; benchmarks/bench_deltanet.py). ``configure`` reads two JSON files and the
tokenizer. Importing this module imports no torch.
"""
from __future__ import annotations

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix
from ray_mmbatch.models.qwen_vl import _vision_modules, vision_modules  # noqa: F401 (the backend protocol's)

NAME = "qwen3_5"
MODEL_TYPES: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe")
# the Qwen/Qwen3.5-* repos ship Qwen3-VL's processors (Qwen3VLVideoProcessor, Qwen3VLProcessor): video as Qwen3-VL's
VIDEO_MODEL_TYPES = MODEL_TYPES


def configure(cfg):
    """Fill cfg's image / text settings from the checkpoint at cfg.model.path (see models/__init__.py).

    As Qwen-VL's (models/qwen_vl.configure): smart resize, patch / merge / temporal sizes (config.json
    vision_config), min / max pixels (the user's value wins) and mean / std from the image processor, the
    tokenizer (the checkpoint's unless --tokenizer), the image token (config.json image_token_id); video as
    Qwen3-VL's (qwen_vl._configure_video: the video processor's settings, else HF's Qwen3VLVideoProcessor
    defaults; the --video-* flags win; the video token from config.json video_token_id). Idempotent.
    """
    from ray_mmbatch.models.qwen_vl import _vision_geometry, configure_qwen

    # Qwen3_5VisionConfig's defaults are Qwen3-VL's (16-pixel patches, 2 x 2 merge, 2 frames): qwen_vl's check
    return configure_qwen(cfg, "qwen3_5", "Qwen3.5", MODEL_TYPES, _vision_geometry, VIDEO_MODEL_TYPES)


def _adapter_class():
    from ray_mmbatch.models.deltanet import SEGMENTS
    from ray_mmbatch.models.qwen_vl import QwenAdapter

    class Qwen35Adapter(QwenAdapter):
        """Qwen-VL's adapter (M-RoPE ids per packed sample, varlen kwargs on flash attention) plus, in pack mode,
        the row's sample boundaries for the Gated DeltaNet layers (models/deltanet.py), whose segment-aware
        forward it checks is still in place (``deltanet.ensure``: ``model.train()`` resets it)."""

        layers: list = []

        def __call__(self, batch: dict):
            from ray_mmbatch.models import deltanet

            deltanet.ensure(self.layers)
            kwargs = super().__call__(batch)
            if batch["mode"] == "pack":
                cu = batch["cu_seqlens"]
                kwargs[SEGMENTS] = tuple(int(c) for c in (cu.tolist() if hasattr(cu, "tolist") else cu))
            return kwargs

    return Qwen35Adapter


fsdp_units, state_prefix = hf_fsdp_units, hf_state_prefix


def create_model(cfg, ids: dict):
    """The checkpoint's Qwen3_5(Moe)ForConditionalGeneration in HFModel, its DeltaNet layers segment-aware."""
    from ray_mmbatch.models import deltanet
    from ray_mmbatch.models.hf_common import wrap
    from ray_mmbatch.models.qwen_vl import load_qwen, qwen_adapter

    hf = load_qwen(cfg, ids)
    layers = deltanet.install(hf)
    if not layers:
        raise ValueError(f"{cfg.model.path}: no Gated DeltaNet layer found in {type(hf).__name__}")
    adapter = qwen_adapter(cfg, hf, _adapter_class())
    adapter.layers = layers
    return wrap(hf, cfg, adapter, _vision_modules, NAME)


export = hf_export  # save_pretrained of model + tokenizer, the processor files copied
