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

Padded batches (right padding) are HF's own path: attention_mask + mm_token_type_ids; the DeltaNet layers are
causal, so the padding after a sample changes nothing before it.

MoE (``qwen3_5_moe``): the loss is the cross-entropy only. The router's load-balancing loss (HF adds
``router_aux_loss_coef`` x it only with ``output_router_logits``, which this backend leaves off) is not added,
packed or padded: a packed row would count the balance over all its samples' tokens together, a padded batch
over rows with their padding masked, so neither would equal the per-sample sum, and exactness is stated on
the CE. Train the router with the CE (or add the aux loss in your own loop, knowing it is per batch).

Cost: that of Qwen-VL's adapter (one ``get_rope_index`` per packed sample with images) plus the DeltaNet
segments (models/deltanet.py; benchmarks/bench_deltanet.py). ``configure`` reads two JSON files and the
tokenizer. Importing this module imports no torch.
"""
from __future__ import annotations

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix
from ray_mmbatch.models.qwen_vl import _vision_modules, vision_modules  # noqa: F401 (the backend protocol's)

NAME = "qwen3_5"
MODEL_TYPES: tuple[str, ...] = ("qwen3_5", "qwen3_5_moe")

# HF's Qwen3_5VisionConfig defaults, for keys a config.json leaves out
_VISION_DEFAULTS = {"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2}


def _vision_geometry(path: str, model_json: dict, processor: dict) -> dict[str, int]:
    """patch / merge / temporal sizes from config.json's vision_config, which the image processor must agree with."""
    vision = model_json.get("vision_config") or {}
    geometry = {"patch_size": vision.get("patch_size"), "merge_size": vision.get("spatial_merge_size"),
                "temporal_patch_size": vision.get("temporal_patch_size")}
    for key, value in geometry.items():
        value = geometry[key] = int(_VISION_DEFAULTS[key] if value is None else value)
        if processor.get(key) is not None and int(processor[key]) != value:
            raise ValueError(f"{path}: the image processor's {key}={processor[key]} disagrees with config.json "
                             f"vision_config ({value}); the checkpoint is inconsistent")
    return geometry


def configure(cfg):
    """Fill cfg's image / text settings from the checkpoint at cfg.model.path (see models/__init__.py).

    As Qwen-VL's (models/qwen_vl.configure): smart resize, patch / merge / temporal sizes (config.json
    vision_config), min / max pixels (the user's value wins) and mean / std from the image processor, the
    tokenizer (the checkpoint's unless --tokenizer), the image token (config.json image_token_id). Video is not
    taken for this family yet (a sample with video is skipped as for an image-only family). Idempotent.
    """
    from ray_mmbatch.models.qwen_vl import configure_qwen

    return configure_qwen(cfg, "qwen3_5", "Qwen3.5", MODEL_TYPES, _vision_geometry)


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
    from ray_mmbatch.models.qwen_vl import load_qwen

    hf = load_qwen(cfg, ids)
    layers = deltanet.install(hf)
    if not layers:
        raise ValueError(f"{cfg.model.path}: no Gated DeltaNet layer found in {type(hf).__name__}")
    adapter = _adapter_class()(hf.model, hf.config.image_token_id, cfg.image.image_mean, cfg.image.image_std,
                               cfg.image.temporal_patch_size)
    adapter.layers = layers
    return wrap(hf, cfg, adapter, _vision_modules, NAME)


export = hf_export  # save_pretrained of model + tokenizer, the processor files copied
