"""Gemma 3 backend (``Gemma3ForConditionalGeneration``): a fixed number of tokens per image, image
blocks attending bidirectionally, sliding-window layers; packed rows get explicit per-layer masks.

Cost model: every image is resized to S x S (a plain bilinear resize, the aspect not kept,
nothing cropped: HF's Gemma 3 image processor; data/image/ resize='squash'), a (1, S/ps, S/ps)
patch grid that the projector average-pools k x k into ``mm_tokens_per_image`` LM tokens, so the
data path's merge_size is k (896 px, 14-px patches, 64 x 64 -> 16 x 16 = 256 tokens in real
checkpoints). Text: the chat template writes ``<start_of_image>`` per image and the processor
replaces it with ``"\\n\\n<start_of_image>" + <image_soft_token> x N + "<end_of_image>\\n\\n"``:
``configure`` sets ``text.image_block`` so the data path does the same in every render before
tokenizing (the blank lines merge with the template's newlines), and materialize repeats the
soft token N times. Pan-and-scan (extra crops, extra text) is refused: the token count per image
would depend on the aspect ratio and the data path has no crops.

Attention. Text is causal; the soft tokens of one image attend to each other both ways (HF:
``token_type_ids`` -> block ids -> OR(causal, same block)); sliding layers AND a window
``kv > q - W`` over that. Packed row of a: text (3) and b: text, one 2-token image, text::

    input_ids    a0 a1 a2 | b0 <boi> I  I  <eoi> b1
    position_ids  0  1  2 |  0   1   2  3   4    5     restart per sample (RoPE only)
    token_type    0  0  0 |  0   0   1  1   0    0     travels with the row (block ids)

    full_attention mask (1 = may attend)    sliding_attention: the same AND kv > q - W
              a0 a1 a2 b0 bo I  I  eo b1
        a0  [  1  .  .  .  .  .  .  .  . ]
        a1  [  1  1  .  .  .  .  .  .  . ]
        a2  [  1  1  1  .  .  .  .  .  . ]
        b0  [  .  .  .  1  .  .  .  .  . ]
        bo  [  .  .  .  1  1  .  .  .  . ]
        I   [  .  .  .  1  1  1  1  .  . ]   <- the image block sees itself, both ways
        I   [  .  .  .  1  1  1  1  .  . ]
        eo  [  .  .  .  1  1  1  1  1  . ]
        b1  [  .  .  .  1  1  1  1  1  1 ]

HF's own packing from position ids is not exact here (transformers 5.25): on the sliding layers
it looks the block ids up by per-sample position, so image blocks of different samples at the
same positions see each other. So pack batches pass ``attention_mask`` as a dict keyed by layer
type, built with transformers' own ``create_causal_mask`` (so each attention implementation
gets its own format: sdpa a bool mask, eager an additive one, flex a BlockMask) from index
functions over the whole row: OR(causal, same image block) AND same sample (AND the window on
sliding layers) -- what HF builds for each sample alone, shifted to its offset. Pad batches
take HF's own path: ``attention_mask`` [B, L] + ``token_type_ids``. flash_attention_2 is refused:
HF does not support it for Gemma 3 (the bidirectional image mask; head_dim 256 in real
checkpoints), so there are no varlen kwargs to pass; 'auto' means sdpa.

Cost: one [1, 1, T, T] mask per layer type per pack batch (two; T = 16k is 256 MB each as bool:
what HF's sdpa path builds for a packed row too); pixels are un-patchified on the device.
Importing this module imports no torch (the registry imports every backend to read MODEL_TYPES).
"""
from __future__ import annotations

import math
from pathlib import Path

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "gemma3"
MODEL_TYPES: tuple[str, ...] = ("gemma3",)
# the rest of the backend protocol (models/__init__.py) is the same for every HF family; export: save_pretrained
# of model + tokenizer, the checkpoint's processor files copied
fsdp_units, state_prefix, export = hf_fsdp_units, hf_state_prefix, hf_export

_BILINEAR = 2  # PIL.Image.Resampling.BILINEAR: Gemma3ImageProcessor's resample
_MEAN = _STD = (0.5, 0.5, 0.5)  # Gemma3ImageProcessor's defaults (IMAGENET_STANDARD_*)
_NO_FLASH = ("Gemma 3 does not run on flash_attention_2 (transformers refuses it: flash-attention drops the "
             "bidirectional image-block mask, and real checkpoints have head_dim 256); use sdpa, eager or "
             "flex_attention (model.attn_implementation)")


def _pixel_settings(pre: dict, where: str) -> dict:
    """ImageConfig values from the image processor; anything data/image/ would not reproduce raises."""
    from ray_mmbatch.models.hf_common import pixel_settings

    pixels = pixel_settings(pre, where, "Gemma 3", resample=_BILINEAR, mean=_MEAN, std=_STD,
                            always=("do_resize", "do_convert_rgb"))
    if pre.get("do_pan_and_scan"):
        raise ValueError(f"{where}: do_pan_and_scan=true is not supported: pan-and-scan adds crops and text per "
                         "image by its aspect ratio, which the data path's fixed cost model does not make")
    size = pre.get("size") or {"height": 224, "width": 224}
    if not (isinstance(size, dict) and size.get("height") and size.get("height") == size.get("width")):
        raise ValueError(f"{where}: size {size!r} is not a square {{'height': S, 'width': S}} (Gemma 3's resize)")
    return {"image_size": int(size["height"]), **pixels}


def _pool_kernel(vision, tokens_per_image: int, where: str) -> int:
    """k of the projector's k x k average pool: (S/ps / k)**2 == mm_tokens_per_image (HF Gemma3MultiModalProjector)."""
    if vision.image_size % vision.patch_size:
        raise ValueError(f"{where}: image size {vision.image_size} is not a multiple of patch_size {vision.patch_size}")
    side = vision.image_size // vision.patch_size
    per_side = math.isqrt(tokens_per_image)
    if per_side * per_side != tokens_per_image or side % per_side:
        raise ValueError(f"{where}: mm_tokens_per_image={tokens_per_image} is not a square that divides the "
                         f"{side} x {side} patch grid")
    return side // per_side


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.models.hf_common import (
        adopt_setting,
        adopt_still_pixels,
        checked_token,
        open_checkpoint,
        read_json,
    )

    path, hf_cfg, processor, where_model, _ = open_checkpoint(cfg, NAME, "Gemma 3", MODEL_TYPES)
    where_proc = f"{path} image processor"
    if getattr(hf_cfg.text_config, "use_bidirectional_attention", False):
        raise ValueError(f"{where_model}: text_config.use_bidirectional_attention=true (an encoder, not a causal "
                         "LM) is not supported")
    vision, n_tokens = hf_cfg.vision_config, int(hf_cfg.mm_tokens_per_image)
    pixels = _pixel_settings(processor, where_proc)
    if pixels["image_size"] != vision.image_size:
        raise ValueError(f"{path}: the processor resizes to {pixels['image_size']} px but the vision tower takes "
                         f"{vision.image_size} px (vision_config.image_size)")
    kernel = _pool_kernel(vision, n_tokens, where_model)
    seq_len = read_json(Path(path) / "processor_config.json").get("image_seq_length", processor.get("image_seq_length"))
    if seq_len is not None and int(seq_len) != n_tokens:
        raise ValueError(f"{path}: the processor writes image_seq_length={seq_len} tokens per image but the "
                         f"model makes mm_tokens_per_image={n_tokens}")

    adopt_setting(cfg, "image.resize", "squash", f"{where_proc} (Gemma 3: plain resize to a square)")
    adopt_setting(cfg, "image.image_size", int(vision.image_size), f"{where_model} vision_config.image_size")
    adopt_setting(cfg, "image.patch_size", int(vision.patch_size), f"{where_model} vision_config.patch_size")
    adopt_setting(cfg, "image.merge_size", kernel, f"{where_model} (Gemma 3: {kernel}x{kernel} average pool "
                                                   f"to mm_tokens_per_image={n_tokens})")
    adopt_still_pixels(cfg, pixels, where_proc, "Gemma 3")
    tok = load_tokenizer(cfg.text.tokenizer)
    image, boi, eoi = (checked_token(tok, getattr(hf_cfg, field), path, field)
                       for field in ("image_token_index", "boi_token_index", "eoi_token_index"))
    source = f"{path} tokenizer, config.json image / boi / eoi token ids"
    adopt_setting(cfg, "text.image_token", image, source)
    # HF Gemma3Processor.full_image_sequence, with the soft token once (materialize repeats it)
    adopt_setting(cfg, "text.image_block", (boi, f"\n\n{boi}{image}{eoi}\n\n"), f"{source} (Gemma3Processor)")
    return cfg


# ------------------------------------------------------------------ model
def pixel_values(patches, side: int, patch_size: int, merge: int, mean, std):
    """uint8 patches of (1, g, g) grids in merge-window order (data/image.patchify) -> float32 [n, 3, side, side]."""
    from ray_mmbatch.models.hf_common import normalize_patches

    g, m = side // patch_size, merge
    x = normalize_patches(patches, mean, std)  # [n*g*g, 3*ps*ps], each row (c, py, px)
    n = x.shape[0] // (g * g)
    # (image, block row, block col, row in block, col in block, c, py, px) -> (image, c, y, x)
    x = x.view(n, g // m, g // m, m, m, 3, patch_size, patch_size).permute(0, 5, 1, 3, 6, 2, 4, 7)
    return x.reshape(n, 3, side, side)


class Gemma3Adapter:
    """batch (collate layout, tensors) -> kwargs of ``Gemma3Model.forward`` (module docstring)."""

    def __init__(self, hf_model, image_cfg):
        self.hf = hf_model
        self.text_config = hf_model.config.get_text_config()
        self.image_token_id = int(hf_model.config.image_token_id)
        self.side, self.ps, self.merge = int(image_cfg.image_size), int(image_cfg.patch_size), int(image_cfg.merge_size)
        self.mean, self.std = tuple(image_cfg.image_mean), tuple(image_cfg.image_std)

    def __call__(self, batch: dict) -> dict:
        ids = batch["input_ids"]
        token_type_ids = (ids == self.image_token_id).long()
        kwargs = {"input_ids": ids, "position_ids": batch["position_ids"], "token_type_ids": token_type_ids}
        if batch["mode"] == "pad":
            kwargs["attention_mask"] = batch["attention_mask"]
        elif batch["mode"] == "pack":
            kwargs["attention_mask"] = self.packed_masks(batch, token_type_ids)
        else:
            raise ValueError(f"unknown batch mode {batch['mode']!r}")
        patches = batch.get("patches")
        if patches is not None and patches.shape[0]:
            g = self.side // self.ps
            grids = batch["image_grid_thw"].reshape(-1, 3)
            if not bool((grids == grids.new_tensor([1, g, g])).all()):
                raise ValueError(f"Gemma 3 takes {self.side}x{self.side} images, grid (1, {g}, {g}); the batch has "
                                 f"grids {grids.unique(dim=0).tolist()} (was the data measured with "
                                 "image.resize='squash'?)")
            x = pixel_values(patches, self.side, self.ps, self.merge, self.mean, self.std)
            kwargs["pixel_values"] = x.to(self.hf.model.vision_tower.dtype)
        return kwargs

    def packed_masks(self, batch: dict, token_type_ids) -> dict:
        """{layer type: mask} of one packed row: OR(causal, same image block) AND same sample (AND the window)."""
        import torch

        (and_masks, blockwise_overlay, create_causal_mask, packed_sequence_mask_function, sliding_window_overlay,
         get_block_sequence_ids_for_mask) = _mask_api()
        ids = batch["input_ids"]
        lens = torch.as_tensor(batch["seq_lens"], device=ids.device).long()
        sample = torch.repeat_interleave(torch.arange(len(lens), device=ids.device), lens)[None]
        blocks = get_block_sequence_ids_for_mask(token_type_ids, device=ids.device)  # unique over the row
        dtype = self.hf.get_input_embeddings().weight.dtype  # what HF's own path builds its mask for
        shape_only = torch.empty((1, ids.shape[1], 1), dtype=dtype, device=ids.device)
        same_sample = packed_sequence_mask_function(sample)

        def mask(*extra):
            return create_causal_mask(config=self.text_config, inputs_embeds=shape_only, attention_mask=None,
                                      cache=None, position_ids=None, or_mask_function=blockwise_overlay(blocks),
                                      and_mask_function=and_masks(same_sample, *extra))

        out = {"full_attention": mask()}
        if self.text_config.sliding_window is not None:
            out["sliding_attention"] = mask(sliding_window_overlay(self.text_config.sliding_window))
        return out


def _mask_api() -> tuple:
    """The transformers mask builders the packed masks use (hf_common.packed_mask_api)."""
    from ray_mmbatch.models.hf_common import packed_mask_api

    return packed_mask_api("gemma3")


def vision_modules(model) -> list:
    """The vision tower and projector of the HFModel (hf_common.tower_and_projector): a batch without images does
    not run them."""
    return model.vision_modules()


def freeze_unused_vision(hf_model) -> int:
    """requires_grad=False on SigLIP's pooling head (``vision_use_head``: Gemma 3 reads last_hidden_state, so the
    head never reaches the loss and DDP would see unused weights); returns the number of frozen weights."""
    from ray_mmbatch.models.hf_common import freeze

    tower = hf_model.model.vision_tower
    return freeze(getattr(getattr(tower, "vision_model", tower), "head", None))


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the Gemma 3 adapter; tokenizer ids checked against it."""
    from ray_mmbatch.models.hf_common import load_checked, tower_and_projector, wrap

    impl = cfg.model.attn_implementation
    if "flash" in impl:
        raise ValueError(f"model.attn_implementation={impl!r}: {_NO_FLASH}")
    hf = load_checked(cfg, ids, "sdpa" if impl == "auto" else impl)
    kernel = _pool_kernel(hf.config.vision_config, int(hf.config.mm_tokens_per_image), cfg.model.path)
    want = {"resize": "squash", "image_size": hf.config.vision_config.image_size,
            "patch_size": hf.config.vision_config.patch_size, "merge_size": kernel}
    for key, value in want.items():
        if getattr(cfg.image, key) != value:
            raise ValueError(f"image.{key} is {getattr(cfg.image, key)!r} but the model's is {value!r}: "
                             "call configure(cfg) before create_model")
    _mask_api()  # fail here, not at the first packed batch
    freeze_unused_vision(hf)
    return wrap(hf, cfg, Gemma3Adapter(hf, cfg.image), tower_and_projector, NAME)

