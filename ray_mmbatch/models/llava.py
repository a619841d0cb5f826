"""LLaVA-1.5 backend (``LlavaForConditionalGeneration``): a fixed number of tokens per image.

Cost model: every image becomes one S x S crop (shortest edge to S, centre crop, as the
checkpoint's CLIP image processor does; resize='fixed_pad' when its LlavaImageProcessor pads
to a square of the mean colour first, ``do_pad``), i.e. a (1, S/ps, S/ps) grid with merge 1,
so an image costs N = (S/ps)**2 LM tokens (576 for llava-1.5 at 336 px) whatever its size:
``configure`` writes that into ImageConfig and the data path measures it from the header.

Forward inputs (``adapter``), on the batch layout of batching/collate.py::

    pixel_values  [n_img, 3, S, S]   uint8 patches -> (x/255 - mean)/std -> un-patchified
                                     (merge 1: patches are row-major over the grid)
    input_ids     ONE image token per image, expanded to N by materialize
    pack          position_ids [1, T] restarting at 0 per sample, NO attention_mask:
                  transformers' create_causal_mask then finds the sample boundaries from the
                  position ids (masking_utils.find_packed_sequence_indices) and builds a
                  block-diagonal causal mask (sdpa, eager, flex); flash_attention_2 gets them
                  explicitly (cu_seq_lens_q/k, max_length_q/k: hf_common.varlen_kwargs, not
                  inferred from the position ids). Needs use_cache=False: with a
                  cache, or with any 2-D attention_mask, HF skips the detection and attention
                  crosses samples (tests/test_models_llava.py catches both).
    pad           attention_mask [B, L] (bool) + position_ids 0..L-1
    text only     no pixel_values (HFModel keeps the vision weights in the graph)

CLIP layers after ``vision_feature_layer`` (-2: the last one) and the pooler's layer norm
never reach the loss; they are frozen so DDP sees no unused trainable parameter.
vision_feature_select_strategy='full' (CLS kept: N + 1 tokens) is refused: the data path's
cost model counts grid tokens (h * w / merge**2) only and has no per-image extra token.
Importing this module imports no torch (the registry imports every backend to read MODEL_TYPES).
"""
from __future__ import annotations

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "llava"
MODEL_TYPES: tuple[str, ...] = ("llava",)
# the rest of the backend protocol (models/__init__.py) is the same for every HF family; export: save_pretrained
# of model + tokenizer, the checkpoint's processor files copied
fsdp_units, state_prefix, export = hf_fsdp_units, hf_state_prefix, hf_export

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, what data/image/ resizes with


def _side(value, where: str, crop: bool) -> int:
    """A side from a processor size field: an int, {'shortest_edge': S} (resize) or {'height': S, 'width': S} (crop)."""
    if isinstance(value, int):
        return value
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
        if not crop and set(value) == {"shortest_edge"}:
            return int(value["shortest_edge"])
        if crop and set(value) == {"height", "width"} and value["height"] == value["width"]:
            return int(value["height"])
    want = "{'height': S, 'width': S}" if crop else "{'shortest_edge': S}"
    raise ValueError(f"{where}: {value!r} is not a fixed-resize setting ({want}); the LLaVA backend supports "
                     "the CLIP processor's shortest-edge resize + square centre crop only")


def _pixel_settings(pre: dict, where: str) -> dict:
    """ImageConfig values from the image processor; anything data/image/ would not reproduce raises."""
    from ray_mmbatch.models.hf_common import CLIP_MEAN, CLIP_STD, pixel_settings

    pixels = pixel_settings(pre, where, "LLaVA", resample=_BICUBIC, mean=CLIP_MEAN, std=CLIP_STD,
                            always=("do_resize", "do_center_crop"))
    resize = "fixed"
    if pre.get("do_pad"):
        if not str(pre.get("image_processor_type", "")).startswith("LlavaImageProcessor"):
            raise ValueError(f"{where}: do_pad=true outside LlavaImageProcessor (pad to square) is not supported")
        if not pre.get("do_normalize", True):  # the pad colour is the mean even when nothing is normalized
            raise ValueError(f"{where}: do_pad with do_normalize=false is not supported")
        resize = "fixed_pad"  # LLaVA's pad to a square of the mean colour, then the same resize + crop
    size = _side(pre.get("size", {"shortest_edge": 224}), f"{where} size", crop=False)
    crop = _side(pre.get("crop_size", {"height": 224, "width": 224}), f"{where} crop_size", crop=True)
    if size != crop:
        raise ValueError(f"{where}: shortest_edge {size} != crop {crop}; the fixed resize takes one side for both")
    return {"resize": resize, "image_size": size, **pixels}


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from ray_mmbatch.models.hf_common import adopt_setting, adopt_still_pixels, image_token, open_checkpoint

    # hf_cfg: the checkpoint's own defaults filled in (a sparse vision_config means CLIP's)
    path, hf_cfg, processor, where_model, where_proc = open_checkpoint(cfg, NAME, "LLaVA", MODEL_TYPES)
    strategy = hf_cfg.vision_feature_select_strategy
    if strategy != "default":
        raise ValueError(f"{where_model}: vision_feature_select_strategy={strategy!r} (CLS token kept, "
                         "(S/ps)**2 + 1 tokens per image) is not supported: the data path's cost model counts "
                         "grid tokens only. Only 'default' (llava-1.5) is.")
    vision = hf_cfg.vision_config
    pixels = _pixel_settings(processor, where_proc)
    if pixels["image_size"] != vision.image_size:
        raise ValueError(f"{path}: the processor crops {pixels['image_size']} px but the vision tower takes "
                         f"{vision.image_size} px (vision_config.image_size)")
    if vision.image_size % vision.patch_size:
        raise ValueError(f"{where_model}: image size {vision.image_size} is not a multiple of patch_size "
                         f"{vision.patch_size}")

    adopt_setting(cfg, "image.resize", pixels["resize"], f"{where_proc} (LLaVA: fixed square crop)")
    adopt_setting(cfg, "image.image_size", int(vision.image_size), f"{where_model} vision_config.image_size")
    adopt_setting(cfg, "image.patch_size", int(vision.patch_size), f"{where_model} vision_config.patch_size")
    adopt_setting(cfg, "image.merge_size", 1, f"{path} (LLaVA: one LM token per patch)")
    adopt_still_pixels(cfg, pixels, where_proc, "LLaVA")
    token_id = int(hf_cfg.image_token_id)
    adopt_setting(cfg, "text.image_token", image_token(cfg.text.tokenizer, token_id, path),
                  f"{path} tokenizer, token id {token_id} (config.json image_token_id)")
    return cfg


# ------------------------------------------------------------------ model
def pixel_values(patches, grid_thw, side: int, patch_size: int, mean, std):
    """uint8 [n*g*g, 3*ps*ps] patches, grids (1, g, g) -> normalized float32 [n, 3, side, side] (merge 1)."""
    import torch

    from ray_mmbatch.models.hf_common import normalize_patches

    g = side // patch_size
    grids = torch.as_tensor(grid_thw).reshape(-1, 3)
    if grids.numel() and not bool((grids == torch.tensor([1, g, g], device=grids.device)).all()):
        raise ValueError(f"LLaVA takes {side}x{side} images, grid (1, {g}, {g}); the batch has grids "
                         f"{grids.unique(dim=0).tolist()} (was the data measured with image.resize='fixed'?)")
    x = normalize_patches(patches, mean, std)  # [n*g*g, 3*ps*ps], each row (c, py, px)
    n = x.shape[0] // (g * g)
    x = x.view(n, g, g, 3, patch_size, patch_size).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(n, 3, side, side)


def make_adapter(hf_model, image_cfg):
    """batch (collate layout, tensors) -> kwargs of ``LlavaModel.forward`` (see module docstring)."""
    from ray_mmbatch.models.hf_common import image_adapter

    side, ps = int(image_cfg.image_size), int(image_cfg.patch_size)
    mean, std = tuple(image_cfg.image_mean), tuple(image_cfg.image_std)

    def images(patches, batch: dict) -> dict:
        x = pixel_values(patches, batch["image_grid_thw"], side, ps, mean, std)
        return {"pixel_values": x.to(hf_model.model.vision_tower.dtype)}

    return image_adapter(hf_model.model.language_model.config, images)


def vision_modules(model) -> list:
    """The vision tower and projector of the HFModel (hf_common.tower_and_projector): a batch without images does
    not run them."""
    return model.vision_modules()


def freeze_unused_vision(hf_model) -> int:
    """requires_grad=False on the CLIP layers past the deepest selected feature layer and on post_layernorm
    (it only feeds the pooled CLS output); returns the number of frozen weights. Other towers: untouched."""
    from ray_mmbatch.models.hf_common import freeze

    tower = hf_model.model.vision_tower
    if getattr(tower.config, "model_type", "") != "clip_vision_model":
        return 0
    body = getattr(tower, "vision_model", tower)  # transformers < 5 nests the CLIP body one level down
    layers = body.encoder.layers
    chosen = hf_model.config.vision_feature_layer
    chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
    deepest = max(c % (len(layers) + 1) for c in chosen)  # hidden_states[k] is the output of layers[k - 1]
    return freeze(*layers[deepest:], body.post_layernorm)


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the LLaVA adapter; tokenizer ids checked against it."""
    from ray_mmbatch.models.hf_common import load_checked, tower_and_projector, wrap

    # a larger tokenizer comes e.g. from text.chat_template='plain', which adds its special tokens
    hf = load_checked(cfg, ids)
    freeze_unused_vision(hf)
    return wrap(hf, cfg, make_adapter(hf, cfg.image), tower_and_projector, NAME)

