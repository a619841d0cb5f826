"""Mistral 3 backend (``Mistral3ForConditionalGeneration``, model_type ``mistral3``): a Pixtral vision tower at the
image's own aspect, 2 x 2 patch merging, ``[IMG_BREAK]`` / ``[IMG_END]`` text tokens around the rows of image tokens;
Mistral-Small-3.1 / 3.2, Magistral Small (text_config ``mistral``), Ministral 3 (``ministral3``).

Cost model (HF ``PixtralProcessor`` calling ``PixtralImageProcessor``, PIL backend; data/image/pixtral.py,
resize='pixtral'): an image over ``size['longest_edge']`` (``image.image_size``: 1540 published) is scaled down,
aspect kept, then each side is rounded up to a multiple of patch_size x spatial_merge_size (28), bicubic. An image of
H x W pixels has (H / 28) rows of (W / 28) image tokens; the processor closes every row but the last with
``[IMG_BREAK]`` and the last with ``[IMG_END]``, so it costs rows x (cols + 1) tokens, rows x cols of them image
tokens (only ``[IMG]`` takes the tower's features). Text: the chat template writes ``[IMG]`` per image;
``configure`` sets ``text.image_block`` = (``[IMG]``, ``[IMG][IMG_END]``) and ``text.image_break`` =
``[IMG_BREAK]``, measure splices ``[IMG][IMG_BREAK]`` in front once per other row (data/row_breaks.py) and
materialize repeats each ``[IMG]`` cols times: the processor's ids. Pixels: (x / 255 - mean) / std, CLIP's mean /
std, rescaled in float64 and rounded once to float32 as HF's PIL backend does (HF's pixels bit for bit).

Forward inputs (``adapter``), on the batch layout of batching/collate.py::

    pixel_values  [n_img, 3, H_max, W_max]  every image of the batch in sample order, zero-padded at the bottom /
                                            right to the largest (as HF's processor pads a batch); the tower cuts
                                            each back to its own size
    image_sizes   [n_img, 2]                (H, W) in pixels of each image (from its grid)
    pack          position_ids [1, T] restarting at 0 per sample, NO attention_mask: transformers'
                  create_causal_mask finds the samples from the restarting position ids and builds a block-diagonal
                  causal mask (sdpa, eager, flex); flash_attention_2 gets cu_seq_lens / max_length explicitly
                  (hf_common.varlen_kwargs). Restarting positions also give Ministral 3's position-dependent query
                  scale (``llama_4_scaling_beta``) each sample's own positions.
    pad           attention_mask [B, L] + position_ids 0..L-1

The tower itself keeps images apart: HF's Pixtral runs all images of a forward as ONE sequence of patches under a
block-diagonal mask, one block per image (``generate_block_attention_mask``; on flash attention, cu_seqlens per
image), with 2-D RoPE positions restarting per image; the patch merger cuts the features per image by
``image_sizes``. So several images in a packed row (or of several samples) see only their own patches, as each
does when its sample runs alone (tests/test_models_mistral3.py checks both).

HF's ``get_image_features`` fails when a forward holds exactly one image token in all (a 1 x 1 .. 28 x 28 image
alone: it squeezes the [1, d] features to [d]); such a batch gets the same features computed without the squeeze
(``one_token_features``), so a batch of that one image trains instead of stopping the run.

Not trained here: video (Mistral 3 takes none: ``image.video`` stays '', so a video sample stops the run at measure
as for every image-only family, VideoRefused naming the clip and the model types that take video), text models
with a ``sliding_window`` (none of the published checkpoints has one; untested here).
Importing this module imports no torch.
"""
from __future__ import annotations

from pathlib import Path

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "mistral3"
MODEL_TYPES: tuple[str, ...] = ("mistral3",)
# the rest of the backend protocol (models/__init__.py) is the same for every HF family
fsdp_units, state_prefix, export = hf_fsdp_units, hf_state_prefix, hf_export

FAMILY = "Mistral 3"
TEXT_TYPES = ("mistral", "ministral3")
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC: PixtralImageProcessor's resample
_PROCESSOR_TYPES = ("PixtralImageProcessor", "PixtralImageProcessorFast", "PixtralImageProcessorPil")
_TOKENS = {"image_token": "[IMG]", "image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]"}


def _longest_edge(size, where: str) -> int:
    """The processor's ``size``: {'longest_edge': L}, or {'height': L, 'width': L} (HF reads both as a bound)."""
    if isinstance(size, dict):
        size = {k: v for k, v in size.items() if v is not None}
        if set(size) == {"longest_edge"}:
            return int(size["longest_edge"])
        if set(size) == {"height", "width"} and size["height"] == size["width"]:
            return int(size["height"])
    raise ValueError(f"{where}: size {size!r} is not {{'longest_edge': L}}; the Mistral 3 backend reproduces the "
                     "Pixtral processor's longest-edge bound only")


def _processor_settings(pre: dict, proc: dict, where: str, hf_cfg) -> dict:
    """ImageConfig values from the image processor ``pre`` and the processor ``proc`` (processor_config.json);
    anything data/image/ would not reproduce, or that contradicts config.json, raises."""
    from ray_mmbatch.models.hf_common import CLIP_MEAN, CLIP_STD, pixel_settings

    pixels = pixel_settings(pre, where, FAMILY, resample=_BICUBIC, mean=CLIP_MEAN, std=CLIP_STD,
                            types=_PROCESSOR_TYPES, always=("do_resize", "do_convert_rgb"))
    if pre.get("do_center_crop"):
        raise ValueError(f"{where}: do_center_crop=true; the Pixtral processor keeps the whole image")
    vision = hf_cfg.vision_config
    ps, merge = int(vision.patch_size), int(hf_cfg.spatial_merge_size)
    for key, want in (("patch_size", ps), ("spatial_merge_size", merge)):
        if key in proc and int(proc[key]) != want:
            raise ValueError(f"{where}: processor_config.json {key} {proc[key]} but config.json has {want} "
                             f"({'vision_config.patch_size' if key == 'patch_size' else key})")
    longest = _longest_edge(pre.get("size", {"longest_edge": 1024}), where)
    return {"patch_size": ps, "merge_size": merge, "image_size": longest, **pixels}


def _check_model(hf_cfg, where: str, longest: int) -> None:
    text = hf_cfg.get_text_config()
    if text.model_type not in TEXT_TYPES:
        raise ValueError(f"{where}: text_config model_type {text.model_type!r}; the Mistral 3 backend trains "
                         f"{list(TEXT_TYPES)}")
    if getattr(text, "sliding_window", None):
        raise ValueError(f"{where}: text_config.sliding_window={text.sliding_window}: no published Mistral 3 "
                         "checkpoint has one and packing with it is untested here")
    vision, merge = hf_cfg.vision_config, int(hf_cfg.spatial_merge_size)
    side = vision.patch_size * merge
    most = -(-longest // side) * merge  # patches along the longest side after rounding up
    if most > vision.image_size // vision.patch_size:
        raise ValueError(f"{where}: images up to {longest} px make {most} patches a side but the tower's RoPE covers "
                         f"{vision.image_size // vision.patch_size} (vision_config.image_size {vision.image_size} / "
                         f"patch_size {vision.patch_size}); lower image.image_size (the longest edge)")


def _image_tokens(tokenizer: str, path: str, hf_cfg, proc: dict) -> dict[str, str]:
    """processor_config.json's image / break / end tokens (PixtralProcessor's defaults where absent), checked: the
    image token is config.json's image_token_index, the other two are added tokens (each one id in any text)."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.models.hf_common import checked_token

    tok = load_tokenizer(tokenizer)
    image = checked_token(tok, hf_cfg.image_token_id, path, "image_token_index")
    names = {k: str(proc.get(k, v)) for k, v in _TOKENS.items()}
    if names["image_token"] != image:
        raise ValueError(f"{path}: processor_config.json image_token {names['image_token']!r} but config.json "
                         f"image_token_index {hf_cfg.image_token_id} is {image!r}")
    added = {t.content for t in tok.added_tokens_decoder.values()}
    for key in ("image_break_token", "image_end_token"):
        if names[key] not in added:
            raise ValueError(f"{path}: {key} {names[key]!r} (processor_config.json) is not an added token of the "
                             "tokenizer, so the processor's text would not tokenize to one id")
    return names


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from ray_mmbatch.models.hf_common import adopt_setting, adopt_still_pixels, open_checkpoint, read_json

    path, hf_cfg, processor, where_model, _ = open_checkpoint(cfg, NAME, FAMILY, MODEL_TYPES)
    where_proc = f"{path} image processor"
    proc = read_json(Path(path) / "processor_config.json")
    settings = _processor_settings(processor, proc, where_proc, hf_cfg)
    adopt_setting(cfg, "image.resize", "pixtral", f"{where_proc} (Mistral 3: longest edge, sides rounded up)")
    adopt_setting(cfg, "image.patch_size", settings["patch_size"], f"{where_model} vision_config.patch_size")
    adopt_setting(cfg, "image.merge_size", settings["merge_size"], f"{where_model} spatial_merge_size")
    # the longest edge is a free choice (HF: the processor's size kwarg), within what the tower's RoPE covers
    adopt_setting(cfg, "image.image_size", settings["image_size"], f"{where_proc} size longest_edge",
                  user_may_override=True)
    _check_model(hf_cfg, where_model, int(cfg.image.image_size))
    adopt_still_pixels(cfg, settings, where_proc, FAMILY)
    names = _image_tokens(cfg.text.tokenizer, path, hf_cfg, proc)
    image, source = names["image_token"], f"{path} tokenizer and processor_config.json (PixtralProcessor)"
    adopt_setting(cfg, "text.image_token", image, source)
    adopt_setting(cfg, "text.image_block", (image, image + names["image_end_token"]), source)
    adopt_setting(cfg, "text.image_break", names["image_break_token"], source)
    adopt_setting(cfg, "text.family", FAMILY, f"{where_model} model_type mistral3")
    return cfg


# ------------------------------------------------------------------ model
def pixel_values(patches, grids, patch_size: int, merge: int, mean, std, dtype):
    """uint8 patches of (1, gh, gw) grids in merge-window order, (c, py, px) each (data/image/ patchify) ->
    (pixel_values [n, 3, H_max, W_max] zero-padded, image_sizes [n, 2] (H, W)) as HF's Pixtral processor makes them:
    rescaled in float64, rounded once to float32, then normalized in float32."""
    import torch

    ps, m, n = patch_size, merge, grids.shape[0]
    sizes = (grids[:, 1:] * ps).long()
    out = torch.zeros((n, 3, int(sizes[:, 0].max()), int(sizes[:, 1].max())), dtype=torch.float32,
                      device=patches.device)
    mu = torch.as_tensor(mean, dtype=torch.float32, device=patches.device).view(3, 1, 1)
    sd = torch.as_tensor(std, dtype=torch.float32, device=patches.device).view(3, 1, 1)
    start = 0
    for i, (_, gh, gw) in enumerate(grids.tolist()):
        count = gh * gw
        x = (patches[start:start + count].to(torch.float64) * (1.0 / 255.0)).to(torch.float32)
        # (block row, block col, row in block, col in block, c, py, px) -> (c, y, x)
        x = x.view(gh // m, gw // m, m, m, 3, ps, ps).permute(4, 0, 2, 5, 1, 3, 6).reshape(3, gh * ps, gw * ps)
        out[i, :, :gh * ps, :gw * ps] = (x - mu) / sd
        start += count
    if start != patches.shape[0]:
        raise ValueError(f"{patches.shape[0]} patches for grids holding {start}")
    return out.to(dtype), sizes


def one_token_features(model, pixel_values, image_sizes) -> dict:
    """``mm_encoder_outputs`` of HF's ``get_image_features`` for a forward of ONE image token in all, which HF's
    own squeezes to the wrong shape: the same tower, selected layer(s) and projector, the features kept 2-D."""
    import torch

    layer = model.config.vision_feature_layer
    out = model.vision_tower(pixel_values, image_sizes=image_sizes, output_hidden_states=True, return_dict=True)
    states = out.hidden_states
    chosen = states[layer] if isinstance(layer, int) else torch.cat([states[k] for k in layer], dim=-1)
    out.pooler_output = (model.multi_modal_projector(chosen.squeeze(0), image_sizes),)
    return {"image": out}


def make_adapter(hf_model, image_cfg):
    """batch (collate layout, tensors) -> kwargs of ``Mistral3Model.forward`` (see module docstring)."""
    from ray_mmbatch.models.hf_common import image_adapter

    ps, m = int(image_cfg.patch_size), int(image_cfg.merge_size)
    mean, std = tuple(image_cfg.image_mean), tuple(image_cfg.image_std)

    def images(patches, batch: dict) -> dict:
        grids = batch["image_grid_thw"].reshape(-1, 3)
        x, sizes = pixel_values(patches, grids, ps, m, mean, std, hf_model.model.vision_tower.dtype)
        if int((grids[:, 1] // m * (grids[:, 2] // m)).sum()) == 1:
            return {"mm_encoder_outputs": one_token_features(hf_model.model, x, sizes), "image_sizes": sizes}
        return {"pixel_values": x, "image_sizes": sizes}

    return image_adapter(hf_model.model.language_model.config, images)


def vision_modules(model) -> list:
    """The vision tower and projector of the HFModel (hf_common.tower_and_projector): a batch without images does
    not run them."""
    return model.vision_modules()


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the Mistral 3 adapter; tokenizer ids checked against it."""
    from ray_mmbatch.models.hf_common import load_checked, tower_and_projector, wrap

    hf = load_checked(cfg, ids)
    _check_model(hf.config, cfg.model.path, int(cfg.image.image_size))
    want = {"resize": "pixtral", "patch_size": hf.config.vision_config.patch_size,
            "merge_size": hf.config.spatial_merge_size}
    for key, value in want.items():
        if getattr(cfg.image, key) != value:
            raise ValueError(f"image.{key} is {getattr(cfg.image, key)!r} but the model's is {value!r}: "
                             "call configure(cfg) before create_model")
    return wrap(hf, cfg, make_adapter(hf, cfg.image), tower_and_projector, NAME)
