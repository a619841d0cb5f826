"""Idefics3 / SmolVLM backend (``Idefics3ForConditionalGeneration``, ``SmolVLMForConditionalGeneration``).

Cost model, HF's PIL image processor formula for formula (data/image/): every image is resized
(Lanczos) so that its longest edge is ``size['longest_edge']`` = max_tiles * S (S =
``max_image_size``; aspect kept, the other side truncated and made even, 1 x 1 images blown up
too). With ``do_image_splitting`` (the checkpoints' default; resize='split') it is resized again
(Lanczos) to sides rounded up to multiples of S and cut into rows x cols S x S views, plus the
whole of it resized to one S x S global view (``split_grid``; a 1 x 1 image makes the full
max_tiles x max_tiles grid); without (resize='global') the first resize is resized to one S x S
view. Every view gives (S/ps)**2 patches pixel-shuffled by ``scale_factor`` into
N = (S/ps)**2 / scale_factor**2 LM tokens (``image_seq_len``: 64 for SmolVLM at 512 px, 169 for
Idefics3 at 364 px). The views are stacked top to bottom, grid (1, views * S/ps, S/ps), merge_size
= scale_factor: an image costs views x N image tokens plus its text block, known from its header.

Text: the chat template writes ``<image>`` per image, which the processor replaces by
``<fake_token_around_image><global-img>`` + ``<image>`` x N + ``<fake_token_around_image>``
(one view), preceded for a split image by one line per row of
``<fake_token_around_image><row_i_col_j>`` + ``<image>`` x N per view and a newline
(data/split_block.py). ``configure`` sets ``text.image_block`` to the one-view block, which the
encoder renders; with splitting, measure splices each image's rows in front of it (the block
depends on the grid), one ``<image>`` per view, and materialize repeats each N times: the
processor's ids. Refused: a tokenizer without the ``<row_i_col_j>`` tokens the grids need,
a non-Lanczos resample, a longest edge that is not a multiple of S, a mean that a uniform image
normalizes to all zeros (HF's model drops an all-zero view as padding).

Forward inputs (``adapter``), on the batch layout of batching/collate.py::

    pixel_values         [1, n_views, 3, S, S]  every view of the batch, in sample order, image order,
                         view order (rows x cols row-major, global view last): uint8 patches ->
                         (x/255 - mean)/std -> un-patchified per view. HF
                         flattens (batch, image) and scatters the images' tokens into the
                         ``<image>`` tokens in row-major order, so one leading dimension of 1
                         puts the views of sample i on sample i's tokens in pack and pad mode.
                         HF drops an all-zero view as padding: a real view never is one here
                         (configure refuses a mean that a uniform image normalizes to 0)
    pixel_attention_mask [1, n_views, S, S] all ones (no view is padded inside)
    pack                 position_ids [1, T] restarting at 0 per sample, NO attention_mask (the
                         Llama mask builder finds the samples from the position ids); on flash
                         attention cu_seq_lens / max_length explicitly (hf_common.varlen_kwargs)
    pad                  attention_mask [B, L] + position_ids 0..L-1

Importing this module imports no torch (the registry imports every backend to read MODEL_TYPES).
"""
from __future__ import annotations

import math
from pathlib import Path

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "idefics3"
MODEL_TYPES: tuple[str, ...] = ("idefics3", "smolvlm")
# the rest of the backend protocol (models/__init__.py) is the same for every HF family; export: save_pretrained
# of model + tokenizer, the checkpoint's processor files copied
fsdp_units, state_prefix, export = hf_fsdp_units, hf_state_prefix, hf_export

_LANCZOS = 1  # PIL.Image.Resampling.LANCZOS: the Idefics3 / SmolVLM processors' resample
_MEAN = _STD = (0.5, 0.5, 0.5)  # their defaults (IMAGENET_STANDARD_*)
_PROCESSOR_TYPES = ("Idefics3ImageProcessor", "Idefics3ImageProcessorFast", "Idefics3ImageProcessorPil",
                    "SmolVLMImageProcessor", "SmolVLMImageProcessorFast", "SmolVLMImageProcessorPil")


def _longest(value, where: str) -> int:
    if isinstance(value, dict) and value.get("longest_edge"):
        return int(value["longest_edge"])
    raise ValueError(f"{where}: {value!r} is not {{'longest_edge': L}} (the Idefics3 / SmolVLM resize)")


def _pixel_settings(pre: dict, where: str) -> dict:
    """ImageConfig values from the image processor; anything data/image/ would not reproduce raises."""
    from ray_mmbatch.models.hf_common import pixel_settings

    pixels = pixel_settings(pre, where, "Idefics3", resample=_LANCZOS, mean=_MEAN, std=_STD, types=_PROCESSOR_TYPES,
                            always=("do_resize", "do_convert_rgb"))
    if all(math.isclose(m * 255, round(m * 255)) and 0 <= round(m * 255) <= 255 for m in pixels["image_mean"]):
        raise ValueError(f"{where}: image_mean {pixels['image_mean']}: a uniform image of colour mean * 255 "
                         "normalizes to all zeros, which the model drops as a padding image (its tokens then have "
                         "no features)")
    side = _longest(pre.get("max_image_size", {"longest_edge": 364}), f"{where} max_image_size")
    longest = _longest(pre.get("size", {"longest_edge": 4 * 364}), f"{where} size")
    if longest % side:
        raise ValueError(f"{where}: size longest_edge {longest} is not a multiple of max_image_size {side} "
                         "(the data path keeps it as image.max_tiles * image.image_size)")
    return {"image_size": side, "max_tiles": longest // side, **pixels,
            "splitting": bool(pre.get("do_image_splitting", True))}


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.data.text.tokenizer import token_id as id_of
    from ray_mmbatch.models.hf_common import adopt_setting, adopt_still_pixels, open_checkpoint, read_json

    path, hf_cfg, processor, where_model, where_proc = open_checkpoint(cfg, NAME, "Idefics3 / SmolVLM", MODEL_TYPES)
    pixels = _pixel_settings(processor, where_proc)
    # image.resize='global' on a splitting checkpoint: HF's processor with do_image_splitting=False (SmolVLM's video
    # frames), the user's choice
    mode = "split" if pixels["splitting"] and cfg.image.resize != "global" else "global"
    vision = hf_cfg.vision_config
    side, patch, merge = int(vision.image_size), int(vision.patch_size), int(hf_cfg.scale_factor)
    if side % patch or (side // patch) % merge:
        raise ValueError(f"{where_model}: image_size {side}, patch_size {patch}, scale_factor {merge}: the view is not "
                         "a whole number of pixel-shuffled tokens")
    if pixels["image_size"] != side:
        raise ValueError(f"{path}: the processor makes {pixels['image_size']} px views (max_image_size) but the vision "
                         f"tower takes {side} px (vision_config.image_size)")
    per_image = (side // patch // merge) ** 2
    seq = read_json(Path(path) / "processor_config.json").get("image_seq_len", per_image)
    if int(seq) != per_image:
        raise ValueError(f"{path}: image_seq_len {seq} but a {side} px view makes {per_image} tokens "
                         f"(({side}/{patch})**2 / {merge}**2)")

    adopt_setting(cfg, "image.resize", mode, f"{where_proc} do_image_splitting={pixels['splitting']}")
    adopt_setting(cfg, "image.image_size", side, f"{where_model} vision_config.image_size")
    adopt_setting(cfg, "image.patch_size", patch, f"{where_model} vision_config.patch_size")
    adopt_setting(cfg, "image.merge_size", merge, f"{where_model} scale_factor")
    # the longest edge is a free choice (HF: the processor's size kwarg, as InternVL's tile bound): the user's wins
    adopt_setting(cfg, "image.max_tiles", pixels["max_tiles"], f"{where_proc} size longest_edge / max_image_size",
                  user_may_override=True)
    if int(cfg.image.max_tiles) < 1:
        raise ValueError(f"image.max_tiles {cfg.image.max_tiles}: the longest edge must be at least one view")
    adopt_still_pixels(cfg, pixels, where_proc, "Idefics3")
    tok = load_tokenizer(cfg.text.tokenizer)
    token_id = int(hf_cfg.image_token_id)
    image = tok.convert_ids_to_tokens(token_id)
    fake = str(getattr(tok, "fake_image_token", None) or "<fake_token_around_image>")
    glob = str(getattr(tok, "global_image_token", None) or "<global-img>")
    for name, token in (("image", image), ("fake image", fake), ("global image", glob)):
        if token is None or id_of(tok, token) is None:
            raise ValueError(f"{cfg.text.tokenizer}: the {name} token {token!r} is not a token of the vocabulary "
                             f"(HF's processor writes it; config.json image_token_id {token_id})")
    if mode == "split":  # rows and cols go up to max_tiles (data/image.split_grid)
        from ray_mmbatch.data.split_block import ROW_COL

        most = int(cfg.image.max_tiles)
        need = [ROW_COL.format(row=r, col=c) for r in range(1, most + 1) for c in range(1, most + 1)]
        missing = [t for t in need if id_of(tok, t) is None]
        if missing:
            raise ValueError(f"{cfg.text.tokenizer}: no tokens {missing[:4]}{'...' if len(missing) > 4 else ''}: image "
                             f"splitting up to {most} x {most} views (image.max_tiles: size longest_edge / "
                             "max_image_size) writes them")
    source = f"{path} tokenizer, token id {token_id} (config.json image_token_id)"
    adopt_setting(cfg, "text.image_token", image, source)
    adopt_setting(cfg, "text.image_block", (image, f"{fake}{glob}{image}{fake}"),
                  f"{source} (Idefics3Processor / SmolVLMProcessor: the one-view block, which ends every image's)")
    return cfg


# ------------------------------------------------------------------ model
def make_adapter(hf_model, image_cfg):
    """batch (collate layout, tensors) -> kwargs of ``Idefics3Model.forward`` (see module docstring): S x S
    views stacked per image, InternVL's stacked-tile layout, with one leading batch dimension."""
    import torch

    from ray_mmbatch.models.internvl import stacked_tiles_adapter

    def images(x, batch: dict) -> dict:
        mask = torch.ones((1, x.shape[0], *x.shape[2:]), dtype=torch.bool, device=x.device)  # none padded
        return {"pixel_values": x[None], "pixel_attention_mask": mask}

    return stacked_tiles_adapter(image_cfg, hf_model.model.text_model.config, hf_model.model.vision_model, images)


def _vision_modules(hf_model) -> list:
    return [hf_model.model.vision_model, hf_model.model.connector]


def vision_modules(model) -> list:
    """The vision tower and connector of the HFModel: a batch without images does not run them."""
    return _vision_modules(model.hf_model)


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the Idefics3 adapter; tokenizer ids checked against it."""
    from ray_mmbatch.models.hf_common import load_checked, wrap

    if cfg.image.resize not in ("split", "global"):
        raise ValueError(f"the idefics3 backend takes image.resize 'split' or 'global', got {cfg.image.resize!r}")
    hf = load_checked(cfg, ids)
    return wrap(hf, cfg, make_adapter(hf, cfg.image), _vision_modules, NAME)

