"""InternVL backend (``InternVLForConditionalGeneration``, HF-format InternVL3 / 3.5): dynamic tiles.

Cost model: HF's InternVL processor cuts every image into the cols x rows grid of S x S tiles
(S = 448) whose aspect is closest to the image's, min_patches..max_patches of them (its
``crop_to_patches``, which the processor always turns on), plus a thumbnail tile of the whole
image when there is more than one; every tile becomes N = (S/ps)**2 * downsample_ratio**2 LM
tokens (pixel shuffle; 256 at 448 px, patch 14, ratio 0.5). So an image costs tiles x N, known
from its header: ``configure`` writes resize='tiles', image_size S, merge_size 1/ratio and the
tile bounds into ImageConfig, and data/image/ measures (``n_tiles``) and decodes (the PIL
GotOcr2 processor's pixels) it. The tiles of an image are stacked top to bottom, so its grid is
(1, tiles * S/ps, S/ps) and the tile count travels per image in ``image_grid_thw`` (and per
sample through ``image_sample_index``), not in pixel_values, which is a flat list of tiles.

Text: the checkpoint's chat template writes one ``<IMG_CONTEXT>`` per image, which HF's processor
replaces by ``<img>`` + context tokens + ``</img>`` (the tokens the tokenizer names
start / context / end image token); ``configure`` sets text.image_block to that replacement, so
the encoder's ids hold ``<img> <IMG_CONTEXT> </img>`` per image and materialize expands the
context token to tiles x N: the HF processor's ids.

Forward inputs (``adapter``), on the batch layout of batching/collate.py::

    pixel_values  [n_tiles, 3, S, S]  every tile of every image, in sample order, then image order,
                                      then tile order (row-major tiles, thumbnail last): uint8
                                      patches -> (x/255 - mean)/std -> un-patchified per tile.
                                      InternViT runs each tile alone, and HF scatters the tiles'
                                      tokens into the context tokens in row order, so the tiles
                                      of sample i land on sample i's tokens in pack and pad mode
    pack          position_ids [1, T] restarting at 0 per sample, NO attention_mask: the causal
                  LM's mask builder finds the samples from the position ids (block-diagonal
                  causal; sdpa, eager); on flash attention the row's cu_seq_lens / max_length go
                  in explicitly (hf_common.varlen_kwargs). use_cache=False (HFModel).
    pad           attention_mask [B, L] + position_ids 0..L-1
    text only     no pixel_values (HFModel keeps the vision weights in the graph)

Refused: vision_feature_select_strategy other than 'default' (the CLS token kept makes the
feature grid non-square, HF cannot pixel-shuffle it), vision_feature_layer other than -1 (a
layer list, or a middle layer that leaves vision weights unused under DDP), an image processor
that is not GotOcr2's tiling one or whose resize / rescale this data path does not reproduce.
Importing this module imports no torch (the registry imports every backend to read MODEL_TYPES).
"""
from __future__ import annotations

import math
from pathlib import Path

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "internvl"
MODEL_TYPES: tuple[str, ...] = ("internvl",)
# the rest of the backend protocol (models/__init__.py) is the same for every HF family; export: save_pretrained
# of model + tokenizer, the checkpoint's processor files copied
fsdp_units, state_prefix, export = hf_fsdp_units, hf_state_prefix, hf_export

_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, what data/image/ resizes with
_IMAGENET_MEAN = (0.485, 0.456, 0.406)  # InternVL's processor settings (convert_internvl_weights_to_hf)
_IMAGENET_STD = (0.229, 0.224, 0.225)
_PROCESSOR_TYPES = ("GotOcr2ImageProcessor", "GotOcr2ImageProcessorFast", "GotOcr2ImageProcessorPil")


def _square(value, where: str) -> int:
    """A side from a size field: an int, [S, S] or {'height': S, 'width': S}."""
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 2 and value[0] == value[1]:
        return int(value[0])
    if isinstance(value, dict):
        value = {k: v for k, v in value.items() if v is not None}
        if set(value) == {"height", "width"} and value["height"] == value["width"]:
            return int(value["height"])
    raise ValueError(f"{where}: {value!r} is not a square tile size ({{'height': S, 'width': S}})")


def _pixel_settings(pre: dict, where: str) -> dict:
    """ImageConfig values from the image processor; anything data/image/ would not reproduce raises."""
    from ray_mmbatch.models.hf_common import pixel_settings

    pixels = pixel_settings(pre, where, "InternVL", resample=_BICUBIC, mean=_IMAGENET_MEAN, std=_IMAGENET_STD,
                            types=_PROCESSOR_TYPES)
    lo, hi = int(pre.get("min_patches", 1)), int(pre.get("max_patches", 12))
    if not 1 <= lo <= hi:
        raise ValueError(f"{where}: min_patches {lo} / max_patches {hi} must satisfy 1 <= min <= max")
    return {"image_size": _square(pre.get("size", {"height": 384, "width": 384}), f"{where} size"),
            **pixels, "min_tiles": lo, "max_tiles": hi}


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from ray_mmbatch.models.hf_common import adopt_setting, adopt_still_pixels, open_checkpoint, read_json

    path, hf_cfg, processor, where_model, where_proc = open_checkpoint(cfg, NAME, "InternVL", MODEL_TYPES)
    if hf_cfg.vision_feature_select_strategy != "default":
        raise ValueError(f"{where_model}: vision_feature_select_strategy={hf_cfg.vision_feature_select_strategy!r} "
                         "(CLS token kept: a non-square feature grid HF cannot pixel-shuffle); only 'default' is "
                         "supported")
    if hf_cfg.vision_feature_layer != -1:
        raise ValueError(f"{where_model}: vision_feature_layer={hf_cfg.vision_feature_layer!r}; only -1 (the last "
                         "layer, InternVL2.5 / 3 / 3.5) is supported (other layers leave vision weights unused)")
    vision = hf_cfg.vision_config
    side = _square(list(vision.image_size), f"{where_model} vision_config.image_size")
    patch = _square(list(vision.patch_size), f"{where_model} vision_config.patch_size")
    merge = round(1 / hf_cfg.downsample_ratio)
    if side % patch or (side // patch) % merge or not math.isclose(merge * hf_cfg.downsample_ratio, 1.0):
        raise ValueError(f"{where_model}: tile {side} px, patch {patch}, downsample_ratio {hf_cfg.downsample_ratio}: "
                         "the tile is not a whole number of pixel-shuffled tokens")
    pixels = _pixel_settings(processor, where_proc)
    if pixels["image_size"] != side:
        raise ValueError(f"{path}: the processor makes {pixels['image_size']} px tiles but the vision tower takes "
                         f"{side} px (vision_config.image_size)")
    per_tile = (side // patch // merge) ** 2
    seq = read_json(Path(path) / "processor_config.json").get("image_seq_length", hf_cfg.image_seq_length)
    if int(seq) != per_tile:
        raise ValueError(f"{path}: image_seq_length {seq} but a {side} px tile makes {per_tile} tokens "
                         f"(({side}/{patch})**2 * {hf_cfg.downsample_ratio}**2)")

    adopt_setting(cfg, "image.resize", "tiles", f"{where_proc} (InternVL: dynamic tiles + thumbnail)")
    adopt_setting(cfg, "image.image_size", side, f"{where_model} vision_config.image_size")
    adopt_setting(cfg, "image.patch_size", patch, f"{where_model} vision_config.patch_size")
    adopt_setting(cfg, "image.merge_size", merge, f"{where_model} downsample_ratio {hf_cfg.downsample_ratio}")
    # the tile bounds are a free choice (ms-swift's MAX_NUM): a user's own value wins
    adopt_setting(cfg, "image.min_tiles", pixels["min_tiles"], f"{where_proc} min_patches", user_may_override=True)
    adopt_setting(cfg, "image.max_tiles", pixels["max_tiles"], f"{where_proc} max_patches", user_may_override=True)
    adopt_still_pixels(cfg, pixels, where_proc, "InternVL")
    token_id = int(hf_cfg.image_token_id)
    start, token, end = _image_tokens(cfg.text.tokenizer, token_id, path)
    source = f"{path} tokenizer, token id {token_id} (config.json image_token_id)"
    adopt_setting(cfg, "text.image_token", token, source)
    adopt_setting(cfg, "text.image_block", (token, start + token + end), f"{source}, its start / end image tokens")
    return cfg


def _image_tokens(tokenizer: str, token_id: int, path: str) -> tuple[str, str, str]:
    """(<img>, <IMG_CONTEXT>, </img>) as the tokenizer names them (HF's InternVL processor reads them there);
    the context token must be config.json's image_token_id."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.data.text.tokenizer import token_id as id_of
    from ray_mmbatch.models.hf_common import checked_token

    tok = load_tokenizer(tokenizer)
    token = checked_token(tok, token_id, path)
    names = ("start_image_token", "context_image_token", "end_image_token")
    start, context, end = (str(getattr(tok, n, None) or "") for n in names)
    if context != token or id_of(tok, start) is None or id_of(tok, end) is None:
        raise ValueError(f"{tokenizer}: the tokenizer's {names} are {(start, context, end)!r}; HF's InternVL processor "
                         f"needs them as tokens of the vocabulary, the context one {token!r} (image_token_id "
                         f"{token_id})")
    return start, token, end


# ------------------------------------------------------------------ model
def pixel_values(patches, grid_thw, side: int, patch_size: int, merge: int, mean, std):
    """uint8 patches of images of stacked tiles, grids (1, k * g, g) -> normalized float32 [sum k, 3, side, side].

    data/image/ patchifies an image of k tiles stacked top to bottom in merge-window order; with
    g = side / patch_size a multiple of ``merge``, every tile's g * g patches are contiguous, so
    the batch's patches are simply tile after tile.
    """
    import torch

    from ray_mmbatch.models.hf_common import normalize_patches

    g, m = side // patch_size, merge
    grids = torch.as_tensor(grid_thw).reshape(-1, 3)
    if grids.numel() and not bool(((grids[:, 0] == 1) & (grids[:, 2] == g) & (grids[:, 1] % g == 0)
                                   & (grids[:, 1] > 0)).all()):
        raise ValueError(f"InternVL takes stacked {side} px tiles, grids (1, k * {g}, {g}); the batch has grids "
                         f"{grids.unique(dim=0).tolist()} (was the data measured with image.resize='tiles'?)")
    x = normalize_patches(patches, mean, std)  # [tiles * g * g, 3 * ps * ps], each row (c, py, px)
    n = x.shape[0] // (g * g)
    # (tile, block row, block col, row in block, col in block, c, py, px) -> (tile, c, y, x)
    x = x.view(n, g // m, g // m, m, m, 3, patch_size, patch_size).permute(0, 5, 1, 3, 6, 2, 4, 7)
    return x.reshape(n, 3, side, side)


def tiles_per_image(grid_thw, side: int, patch_size: int):
    """Tiles of every image of a batch (its grid's height over one tile's): what slices ``pixel_values``."""
    import torch

    return torch.as_tensor(grid_thw).reshape(-1, 3)[:, 1] // (side // patch_size)


def stacked_tiles_adapter(image_cfg, text_config, tower, images=lambda x, batch: {"pixel_values": x}):
    """``adapter`` of a backend whose images are stacked S x S tiles (InternVL's tiles, Idefics3's views):
    hf_common.image_adapter whose image kwargs are ``images(x, batch)`` of the batch's tiles ``x`` as
    ``pixel_values`` makes them ([n_tiles, 3, S, S], in ``tower``'s dtype)."""
    from ray_mmbatch.models.hf_common import image_adapter

    side, ps, merge = int(image_cfg.image_size), int(image_cfg.patch_size), int(image_cfg.merge_size)
    mean, std = tuple(image_cfg.image_mean), tuple(image_cfg.image_std)

    def tiles(patches, batch: dict) -> dict:
        x = pixel_values(patches, batch["image_grid_thw"], side, ps, merge, mean, std)
        return images(x.to(tower.dtype), batch)

    return image_adapter(text_config, tiles)


def make_adapter(hf_model, image_cfg):
    """batch (collate layout, tensors) -> kwargs of ``InternVLModel.forward`` (see module docstring)."""
    return stacked_tiles_adapter(image_cfg, hf_model.model.language_model.config, hf_model.model.vision_tower)


def vision_modules(model) -> list:
    """The vision tower and projector of the HFModel (hf_common.tower_and_projector): a batch without images does
    not run them."""
    return model.vision_modules()


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the InternVL adapter; tokenizer ids checked against it."""
    from ray_mmbatch.models.hf_common import load_checked, tower_and_projector, wrap

    hf = load_checked(cfg, ids)
    embeddings = hf.model.vision_tower.embeddings
    if getattr(embeddings, "mask_token", None) is not None:  # masked image modelling only: never in the loss
        embeddings.mask_token.requires_grad_(False)
    return wrap(hf, cfg, make_adapter(hf, cfg.image), tower_and_projector, NAME)

