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

import math

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "llava"
MODEL_TYPES: tuple[str, ...] = ("llava",)

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, what data/image.py resizes with
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIPImageProcessor's defaults
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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
    """ImageConfig values from the image processor; anything data/image.py would not reproduce raises."""
    if not pre:
        raise FileNotFoundError(f"{where}: missing (nor a processor_config.json with an image_processor): "
                                "the LLaVA backend takes its pixel settings from it")
    resize = "fixed"
    if pre.get("do_pad"):
        if not str(pre.get("image_processor_type", "")).startswith("LlavaImageProcessor"):
            raise ValueError(f"{where}: do_pad=true outside LlavaImageProcessor (pad to square) is not supported")
        resize = "fixed_pad"  # LLaVA's pad to a square of the mean colour, then the same resize + crop
    if not pre.get("do_resize", True) or not pre.get("do_center_crop", True):
        raise ValueError(f"{where}: do_resize and do_center_crop must be on (the fixed resize does both)")
    size = _side(pre.get("size", {"shortest_edge": 224}), f"{where} size", crop=False)
    crop = _side(pre.get("crop_size", {"height": 224, "width": 224}), f"{where} crop_size", crop=True)
    if size != crop:
        raise ValueError(f"{where}: shortest_edge {size} != crop {crop}; the fixed resize takes one side for both")
    if int(pre.get("resample", _BICUBIC)) != _BICUBIC:
        raise ValueError(f"{where}: resample={pre.get('resample')}; only bicubic (3) matches the data path's resize")
    if not pre.get("do_rescale", True) or not math.isclose(float(pre.get("rescale_factor", 1 / 255)), 1 / 255):
        raise ValueError(f"{where}: pixels must be rescaled by 1/255 (do_rescale, rescale_factor)")
    mean, std = pre.get("image_mean", _CLIP_MEAN), pre.get("image_std", _CLIP_STD)
    mean = (mean,) * 3 if isinstance(mean, (int, float)) else tuple(mean)
    std = (std,) * 3 if isinstance(std, (int, float)) else tuple(std)
    if not pre.get("do_normalize", True):
        if resize == "fixed_pad":  # the pad colour is the mean even when nothing is normalized
            raise ValueError(f"{where}: do_pad with do_normalize=false is not supported")
        mean, std = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return {"resize": resize, "image_size": size, "image_mean": mean, "image_std": std}


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from transformers import AutoConfig  # the checkpoint's own defaults (a sparse vision_config means CLIP's)

    from ray_mmbatch.models.hf_common import adopt_setting, checkpoint_files

    path = cfg.model.path
    if not path:
        raise ValueError("the llava backend trains a Hugging Face checkpoint: set model.path")
    raw, processor = checkpoint_files(path)
    if raw.get("model_type") not in MODEL_TYPES:
        raise ValueError(f"{path}: model_type {raw.get('model_type')!r} is not LLaVA ({list(MODEL_TYPES)})")
    hf_cfg = AutoConfig.from_pretrained(path)
    where_model, where_proc = f"{path}/config.json", f"{path}/preprocessor_config.json"
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
    adopt_setting(cfg, "image.temporal_patch_size", 1, f"{path} (LLaVA: still images)")
    for key in ("image_mean", "image_std"):
        adopt_setting(cfg, f"image.{key}", pixels[key], f"{where_proc} {key}")
    if not cfg.text.tokenizer:
        cfg.text.tokenizer = path
    token_id = int(hf_cfg.image_token_id)
    adopt_setting(cfg, "text.image_token", _image_token(cfg.text.tokenizer, token_id, path),
                  f"{path} tokenizer, token id {token_id} (config.json image_token_id)")
    return cfg


def _image_token(tokenizer: str, token_id: int, path: str) -> str:
    from ray_mmbatch.data.text.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    token = tok.convert_ids_to_tokens(token_id)
    if token is None or tok.convert_tokens_to_ids(token) != token_id:
        raise ValueError(f"{path}: image_token_id {token_id} is not a token of the tokenizer {tokenizer}")
    return token


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
    from ray_mmbatch.models.hf_common import varlen_kwargs

    side, ps = int(image_cfg.image_size), int(image_cfg.patch_size)
    mean, std = tuple(image_cfg.image_mean), tuple(image_cfg.image_std)
    text_config = hf_model.model.language_model.config

    def adapter(batch: dict) -> dict:
        kwargs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"]}
        if batch["mode"] == "pad":
            kwargs["attention_mask"] = batch["attention_mask"]
        elif batch["mode"] == "pack":  # flash attention: the boundaries given explicitly (hf_common.varlen_kwargs)
            kwargs.update(varlen_kwargs(batch, text_config))
        else:
            raise ValueError(f"unknown batch mode {batch['mode']!r}")
        patches = batch.get("patches")
        if patches is not None and patches.shape[0]:
            dtype = hf_model.model.vision_tower.dtype
            kwargs["pixel_values"] = pixel_values(patches, batch["image_grid_thw"], side, ps, mean, std).to(dtype)
        return kwargs

    return adapter


def _vision_modules(hf_model) -> list:
    return [hf_model.model.vision_tower, hf_model.model.multi_modal_projector]


def vision_modules(model) -> list:
    """The vision tower and projector of the HFModel: a batch without images does not run them."""
    return _vision_modules(model.hf_model)


# the rest of the backend protocol (models/__init__.py) is the same for every HF family
fsdp_units, state_prefix = hf_fsdp_units, hf_state_prefix


def freeze_unused_vision(hf_model) -> int:
    """requires_grad=False on the CLIP layers past the deepest selected feature layer and on post_layernorm
    (it only feeds the pooled CLS output); returns the number of frozen weights. Other towers: untouched."""
    tower = hf_model.model.vision_tower
    if getattr(tower.config, "model_type", "") != "clip_vision_model":
        return 0
    body = getattr(tower, "vision_model", tower)  # transformers < 5 nests the CLIP body one level down
    layers = body.encoder.layers
    chosen = hf_model.config.vision_feature_layer
    chosen = chosen if isinstance(chosen, (list, tuple)) else [chosen]
    deepest = max(c % (len(layers) + 1) for c in chosen)  # hidden_states[k] is the output of layers[k - 1]
    n = 0
    for module in [*layers[deepest:], body.post_layernorm]:
        for p in module.parameters():
            p.requires_grad_(False)
            n += p.numel()
    return n


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the LLaVA adapter; tokenizer ids checked against it."""
    from ray_mmbatch.models.hf_common import load_checked, wrap

    # a larger tokenizer comes e.g. from text.chat_template='plain', which adds its special tokens
    hf = load_checked(cfg, ids)
    freeze_unused_vision(hf)
    return wrap(hf, cfg, make_adapter(hf, cfg.image), _vision_modules, NAME)


export = hf_export  # save_pretrained of model + tokenizer, the processor files copied
