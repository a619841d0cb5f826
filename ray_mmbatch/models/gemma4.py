"""Gemma 4 backend (``Gemma4ForConditionalGeneration``, model_type ``gemma4``): images at their own aspect within
a patch budget, image blocks bidirectional on the sliding layers only; packed rows get explicit per-layer masks.

Cost model (HF ``Gemma4ImageProcessor``, PIL backend): the aspect is kept, the image is scaled bicubic so its
area is the patch budget and its sides floored to multiples of patch_size x k (k = ``pooling_kernel_size``,
3 in the published checkpoints), small images scaled up (data/image/budget.py, resize='budget'); the tower
averages k x k patches into one LM token, so merge_size is k and an image costs gh * gw / k**2 tokens, at most
``max_soft_tokens`` (70 / 140 / 280 / 560 / 1120; the budget is max_soft_tokens x k**2 patches, ``max_pixels``
= that x patch_size**2). Pixels are rescaled to [0, 1] and not normalized (the model maps them to [-1, 1]).
Text: the chat template writes ``<|image|>`` per image and the processor replaces it with
``<|image>`` + ``<|image|>`` x N + ``<image|>``: ``configure`` sets ``text.image_block`` so every render
does the same before tokenizing, and materialize repeats the soft token N times.

Tower inputs, as the processor makes them: per image ``pixel_values`` [max_patches, ps * ps * 3] (patches
row-major, each (py, px, c)) zero-padded to the budget, and ``image_position_ids`` [max_patches, 2] = (x, y)
per patch, -1 on the padding. The data path carries uint8 patches in merge-window order, (c, py, px); the
adapter reorders them on the device.

Attention (HF ``create_masks_for_vision_model`` with ``use_bidirectional_attention='vision'``): the full
layers are causal only; the sliding layers are AND(window, OR(causal, same image block)), block ids from
``mm_token_type_ids`` (1 on image soft tokens; ``<|image>`` / ``<image|>`` are text). Packed row of a: text
(3) and b: text, one 2-token image, text::

    input_ids      a0 a1 a2 | b0 <|image> I  I  <image|> b1
    position_ids    0  1  2 |  0    1     2  3     4     5    restart per sample (RoPE only)
    mm_token_type   0  0  0 |  0    0     1  1     0     0

    full_attention (causal, per sample)      sliding_attention (window W not drawn)
              a0 a1 a2 b0 bo I  I  eo b1              a0 a1 a2 b0 bo I  I  eo b1
        a0  [  1  .  .  .  .  .  .  .  . ]      a0  [  1  .  .  .  .  .  .  .  . ]
        a1  [  1  1  .  .  .  .  .  .  . ]      a1  [  1  1  .  .  .  .  .  .  . ]
        a2  [  1  1  1  .  .  .  .  .  . ]      a2  [  1  1  1  .  .  .  .  .  . ]
        b0  [  .  .  .  1  .  .  .  .  . ]      b0  [  .  .  .  1  .  .  .  .  . ]
        bo  [  .  .  .  1  1  .  .  .  . ]      bo  [  .  .  .  1  1  .  .  .  . ]
        I   [  .  .  .  1  1  1  .  .  . ]      I   [  .  .  .  1  1  1  1  .  . ]  <- both ways, sliding only
        I   [  .  .  .  1  1  1  1  .  . ]      I   [  .  .  .  1  1  1  1  .  . ]
        eo  [  .  .  .  1  1  1  1  1  . ]      eo  [  .  .  .  1  1  1  1  1  . ]
        b1  [  .  .  .  1  1  1  1  1  1 ]      b1  [  .  .  .  1  1  1  1  1  1 ]

HF's own packing from restarting position ids is not exact here (transformers 5.25; relative 8.9e-3 on the tiny
checkpoint: its sliding mask does not keep the samples apart around the image blocks), so pack batches pass
``attention_mask`` as a dict keyed by layer type, built with transformers' ``create_causal_mask`` (each
attention implementation gets its own format: sdpa a bool mask, eager an additive one, flex a BlockMask) from
index functions over the whole row: causal AND same sample on full layers; OR(causal, same image block) AND
same sample AND the window on sliding ones -- what HF builds for each sample alone, shifted to its offset. Pad
batches take HF's own path: ``attention_mask`` [B, L] + ``mm_token_type_ids``. What else the model does is per
token or per layer and needs nothing per sample: per-layer inputs (PLE) from each token's id, KV sharing
(a later layer reuses an earlier layer's keys / values of the same type, under the same mask), the final
logit softcap (HFModel.head applies it, as HF does). flash_attention_2 is refused (HF does not support it for
Gemma 4: flash drops the bidirectional image mask); 'auto' means sdpa.

Video (HF ``Gemma4VideoProcessor`` / ``Gemma4Processor.replace_video_token``): frames sampled as BaseVideoProcessor
samples them (``num_frames`` 32 published; data/video/sampling.py), each resized as an image is into the video's own
budget (``max_soft_tokens`` 70 published: ``image.video_max_pixels``), one temporal patch a frame, grid (frames, gh,
gw). The text for the template's ``<|video|>``: per frame ``mm:ss `` + ``<|image>`` + N x ``<|video|>`` +
``<image|>``, frames joined by a space (data/measure.gemma4_frame_blocks; materialize repeats each video token N
times). The adapter gives ``pixel_values_videos`` [frames, video max_patches, ps * ps * 3] (normalized as HF's
torchvision backend does: fused, in float32), ``video_position_ids`` and ``num_frames_per_video``;
``mm_token_type_ids`` is 2 on video soft tokens, so each frame's run is a block of its own, bidirectional on the
sliding layers exactly as an image's (the packed masks above do not change).

Not trained here: audio (no audio in the data path: a user turn with an ``<audio>`` slot -- an HF messages audio part
becomes one -- is skipped as unsupported_modality naming Gemma 4 and audio, data/text/conversations.py;
an audio tower is frozen so DDP sees no unused weights), ``use_bidirectional_attention
='all'`` (an encoder), MoE checkpoints (``enable_moe_block``: untested here).

Cost: one [1, 1, T, T] mask per layer type per pack batch (two; T = 16k is 256 MB each as bool), every image
padded to the budget in the tower (as HF's processor pads it). Importing this module imports no torch.
"""
from __future__ import annotations

from ray_mmbatch.models import hf_export, hf_fsdp_units, hf_state_prefix

NAME = "gemma4"
MODEL_TYPES: tuple[str, ...] = ("gemma4",)
VIDEO_MODEL_TYPES: tuple[str, ...] = MODEL_TYPES
"""The model types whose checkpoints train on video too (models.video_model_types)."""
# the rest of the backend protocol (models/__init__.py) is the same for every HF family
fsdp_units, state_prefix, export = hf_fsdp_units, hf_state_prefix, hf_export

FAMILY = "Gemma 4"
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC: Gemma4ImageProcessor's resample
_SOFT_TOKENS = (70, 140, 280, 560, 1120)  # HF's _SUPPORTED_SOFT_TOKENS
_PROCESSOR_DEFAULTS = {"patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 280, "do_normalize": False}
_NO_FLASH = ("Gemma 4 does not run on flash_attention_2 (transformers refuses it: flash-attention drops the "
             "bidirectional image-block mask); use sdpa, eager or flex_attention (model.attn_implementation)")


def _processor_settings(pre: dict, where: str, vision) -> dict:
    """ImageConfig values from the image processor; anything data/image/ would not reproduce raises."""
    from ray_mmbatch.models.hf_common import pixel_settings

    pre = {**_PROCESSOR_DEFAULTS, **pre}
    pixels = pixel_settings(pre, where, FAMILY, resample=_BICUBIC, mean=(0.0,) * 3, std=(1.0,) * 3,
                            always=("do_resize", "do_convert_rgb"))
    ps, k, n = int(pre["patch_size"]), int(pre["pooling_kernel_size"]), int(pre["max_soft_tokens"])
    if n not in _SOFT_TOKENS:
        raise ValueError(f"{where}: max_soft_tokens={n}; HF's Gemma 4 processor takes {list(_SOFT_TOKENS)}")
    if (ps, k) != (int(vision.patch_size), int(vision.pooling_kernel_size)):
        raise ValueError(f"{where}: patch_size {ps} / pooling_kernel_size {k} but the vision tower has "
                         f"{vision.patch_size} / {vision.pooling_kernel_size} (config.json vision_config)")
    return {"patch_size": ps, "merge_size": k, "max_pixels": n * k * k * ps * ps, **pixels}


def _check_model(hf_cfg, where: str) -> None:
    text = hf_cfg.get_text_config()
    if hf_cfg.vision_config is None:
        raise ValueError(f"{where}: no vision_config (a text-only Gemma 4): train it as a text model")
    if getattr(text, "use_bidirectional_attention", None) == "all":
        raise ValueError(f"{where}: text_config.use_bidirectional_attention='all' (an encoder, not a causal LM) "
                         "is not supported")
    if getattr(text, "enable_moe_block", False):
        raise ValueError(f"{where}: text_config.enable_moe_block=true (Gemma 4 MoE) is not supported yet: its "
                         "packing is untested here")


def configure(cfg):
    """Fill the data path's settings from the checkpoint (see module docstring); contradicting flags raise."""
    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.models.hf_common import adopt_setting, adopt_still_pixels, checked_token, open_checkpoint

    path, hf_cfg, processor, where_model, _ = open_checkpoint(cfg, NAME, FAMILY, MODEL_TYPES)
    where_proc = f"{path} image processor"
    _check_model(hf_cfg, where_model)
    settings = _processor_settings(processor, where_proc, hf_cfg.vision_config)
    k = settings["merge_size"]
    adopt_setting(cfg, "image.resize", "budget", f"{where_proc} (Gemma 4: aspect kept within a patch budget)")
    adopt_setting(cfg, "image.patch_size", settings["patch_size"], f"{where_proc} patch_size")
    adopt_setting(cfg, "image.merge_size", k, f"{where_proc} (Gemma 4: {k}x{k} pooling_kernel_size)")
    adopt_setting(cfg, "image.max_pixels", settings["max_pixels"],
                  f"{where_proc} (max_soft_tokens x pooling_kernel_size**2 patches of patch_size**2 pixels)")
    adopt_still_pixels(cfg, settings, where_proc, FAMILY)
    tok = load_tokenizer(cfg.text.tokenizer)
    image, boi, eoi = (checked_token(tok, getattr(hf_cfg, field), path, field)
                       for field in ("image_token_id", "boi_token_id", "eoi_token_id"))
    source = f"{path} tokenizer, config.json image / boi / eoi token ids"
    adopt_setting(cfg, "text.image_token", image, source)
    adopt_setting(cfg, "text.family", FAMILY, f"{where_model} model_type gemma4")
    # HF Gemma4Processor.replace_image_token, with the soft token once (materialize repeats it)
    adopt_setting(cfg, "text.image_block", (image, f"{boi}{image}{eoi}"), f"{source} (Gemma4Processor)")
    _configure_video(cfg, path, hf_cfg, tok, settings)
    return cfg


# HF Gemma4VideoProcessor's class defaults, for what a checkpoint's video processor leaves out (the published
# google/gemma-4-* processor_config.json "video_processor" says the same: 32 frames, 70 soft tokens a frame)
_VIDEO_DEFAULTS = {"do_sample_frames": True, "fps": None, "num_frames": 32, "image_mean": (0.0,) * 3,
                   "image_std": (1.0,) * 3, "patch_size": 16, "pooling_kernel_size": 3, "max_soft_tokens": 70}


def _configure_video(cfg, path: str, hf_cfg, tok, image: dict) -> None:
    """image.video* and text.video_token from the checkpoint's video processor (HF Gemma4VideoProcessor: frames
    sampled as BaseVideoProcessor samples them, num_frames 32 by default; each frame resized as an image is, into a
    budget of max_soft_tokens pooled patches, 70 by default; pixels rescaled to [0, 1]). --video-fps samples at that
    rate instead of num_frames (HF refuses both at once); --video-min-frames / --video-max-frames / --video-max-tokens
    bound that count; --video-max-pixels takes another of HF's budgets (max_soft_tokens x pooling**2 x patch**2).
    A checkpoint without video settings whose tower HF's defaults (16 px patches, 3 x 3 pooling) do not fit takes
    no video (image.video stays '': a video sample stops the run at measure)."""
    from ray_mmbatch.models.hf_common import (
        UNBOUNDED,
        adopt_setting,
        adopt_video_settings,
        checked_token,
        has_video_settings,
        user_set,
        video_processor_settings,
    )

    video, where = video_processor_settings(path)
    where = f"{path} {where}" if video else f"HF Gemma4VideoProcessor's defaults ({path} ships no video settings)"
    get = {k: video.get(k, d) for k, d in _VIDEO_DEFAULTS.items()}
    if has_video_settings(video) and str(video.get("video_processor_type", "Gemma4VideoProcessor")) \
            != "Gemma4VideoProcessor":
        raise ValueError(f"{where}: video_processor_type {video['video_processor_type']!r}; the gemma4 backend "
                         "reproduces Gemma4VideoProcessor only")
    ps, k = int(get["patch_size"]), int(get["pooling_kernel_size"])
    if (ps, k) != (image["patch_size"], image["merge_size"]) and not has_video_settings(video):
        return  # HF's defaults do not fit this tower and the checkpoint says nothing of video: it takes none
    if (ps, k) != (image["patch_size"], image["merge_size"]):
        raise ValueError(f"{where}: patch_size {ps} / pooling_kernel_size {k} but the vision tower has "
                         f"{image['patch_size']} / {image['merge_size']}")
    budgets = {n: n * k * k * ps * ps for n in _SOFT_TOKENS}
    if int(get["max_soft_tokens"]) not in budgets:
        raise ValueError(f"{where}: max_soft_tokens={get['max_soft_tokens']}; HF's Gemma 4 processor takes "
                         f"{list(_SOFT_TOKENS)}")
    if get["fps"] is not None and get["num_frames"] is not None:
        raise ValueError(f"{where}: fps {get['fps']} and num_frames {get['num_frames']} both set (num_frames "
                         f"{_VIDEO_DEFAULTS['num_frames']} when left out); HF's sampler refuses them together")
    if cfg.image.video_fps is not None and cfg.image.video_fps != get["fps"]:  # the user's rate, not num_frames
        video = {**video, "num_frames": None}
    pixels = cfg.image.video_max_pixels
    if user_set(cfg, "image.video_max_pixels") and pixels not in budgets.values():
        raise ValueError(f"image.video_max_pixels = {pixels} (--video-max-pixels) is none of Gemma 4's frame budgets "
                         f"(max_soft_tokens x {k}**2 x {ps}**2 pixels): "
                         f"{', '.join(f'{v} ({n} tokens)' for n, v in budgets.items())}")
    adopt_setting(cfg, "image.video", NAME, f"{path} (HF Gemma4VideoProcessor)")
    adopt_video_settings(cfg, video, where, FAMILY, _VIDEO_DEFAULTS)
    adopt_setting(cfg, "image.video_max_pixels", budgets[int(get["max_soft_tokens"])],
                  f"{where} max_soft_tokens {get['max_soft_tokens']} x {k}**2 x {ps}**2", user_may_override=True)
    adopt_setting(cfg, "image.video_min_frames", 1, f"{where}: HF's sampler has no min_frames", user_may_override=True)
    adopt_setting(cfg, "image.video_max_frames", UNBOUNDED, f"{where}: HF's sampler has no max_frames",
                  user_may_override=True)
    adopt_setting(cfg, "image.video_max_tokens", UNBOUNDED, f"{where}: HF's processor has no token cap",
                  user_may_override=True)
    token = checked_token(tok, hf_cfg.video_token_id, path, "video_token_id")
    adopt_setting(cfg, "text.video_token", token, f"{path} tokenizer, config.json video_token_id")


# ------------------------------------------------------------------ model
def rescale(patches):
    """uint8 patches -> float32 in [0, 1], rescaled in float64 then rounded once to float32, as HF's Gemma 4 image
    processor (PIL backend) rescales: its very pixels, not 1 ulp off."""
    import torch

    return (patches.to(torch.float64) * (1.0 / 255.0)).to(torch.float32)


def tower_inputs(patches, grids, patch_size: int, merge: int, max_patches: int, dtype):
    """float32 patches of (1, gh, gw) grids in merge-window order, (c, py, px) each (data/image/ patchify; images
    through ``rescale``, video frames as HF's video processor normalizes them) -> (pixel_values [n, max_patches,
    ps * ps * 3], position ids [n, max_patches, 2]) as HF's Gemma 4 processors make them: patches row-major, each
    (py, px, c), zero-padded; positions (x, y), -1 padding."""
    import torch

    ps, k, n = patch_size, merge, grids.shape[0]
    pixels = torch.zeros((n, max_patches, ps * ps * 3), dtype=dtype, device=patches.device)
    positions = torch.full((n, max_patches, 2), -1, dtype=torch.long, device=patches.device)
    start = 0
    for i, (_, gh, gw) in enumerate(grids.tolist()):
        count = gh * gw
        if count > max_patches:
            raise ValueError(f"an image of {gh} x {gw} patches is over the budget of {max_patches} (was the data "
                             "measured with this checkpoint's image settings?)")
        x = patches[start:start + count]
        # (block row, block col, row in block, col in block, c, py, px) -> (row, col, py, px, c)
        x = x.view(gh // k, gw // k, k, k, 3, ps, ps).permute(0, 2, 1, 3, 5, 6, 4).reshape(count, -1)
        pixels[i, :count] = x.to(dtype)
        at = torch.arange(count, device=patches.device)
        positions[i, :count, 0], positions[i, :count, 1] = at % gw, at // gw
        start += count
    if start != patches.shape[0]:
        raise ValueError(f"{patches.shape[0]} patches for grids holding {start}")
    return pixels, positions


class Gemma4Adapter:
    """batch (collate layout, tensors) -> kwargs of ``Gemma4Model.forward`` (module docstring)."""

    def __init__(self, hf_model, image_cfg):
        self.hf = hf_model
        self.text_config = hf_model.config.get_text_config()
        self.image_token_id = int(hf_model.config.image_token_id)
        self.ps, self.merge = int(image_cfg.patch_size), int(image_cfg.merge_size)
        self.max_patches = int(image_cfg.max_pixels) // (self.ps * self.ps)
        self.bidirectional = getattr(self.text_config, "use_bidirectional_attention", None) == "vision"
        video_id = getattr(hf_model.config, "video_token_id", None)
        self.video_token_id = -1 if video_id is None else int(video_id)
        self.video_max_patches = int(image_cfg.video_max_pixels) // (self.ps * self.ps)
        self.video_mean = tuple(image_cfg.video_mean or image_cfg.image_mean)
        self.video_std = tuple(image_cfg.video_std or image_cfg.image_std)

    def __call__(self, batch: dict) -> dict:
        ids = batch["input_ids"]
        # as HF's processor types them: 1 image soft tokens, 2 video soft tokens; each run a bidirectional block
        mm_token_type_ids = (ids == self.image_token_id).long() + 2 * (ids == self.video_token_id).long()
        kwargs = {"input_ids": ids, "position_ids": batch["position_ids"], "mm_token_type_ids": mm_token_type_ids}
        if batch["mode"] == "pad":
            kwargs["attention_mask"] = batch["attention_mask"]
        elif batch["mode"] == "pack":
            kwargs["attention_mask"] = self.packed_masks(batch, mm_token_type_ids)
        else:
            raise ValueError(f"unknown batch mode {batch['mode']!r}")
        patches = batch.get("patches")
        if patches is not None and patches.shape[0]:
            tower = self.hf.model.vision_tower
            dtype = tower.patch_embedder.input_proj.weight.dtype
            kwargs["pixel_values"], kwargs["image_position_ids"] = tower_inputs(
                rescale(patches), batch["image_grid_thw"].reshape(-1, 3), self.ps, self.merge, self.max_patches,
                dtype)
        vgrids = batch.get("video_grid_thw")
        if vgrids is not None and vgrids.shape[0]:
            kwargs.update(self.video_inputs(batch["video_patches"], vgrids.reshape(-1, 3).long()))
        return kwargs

    def video_inputs(self, patches, grids) -> dict:
        """The clips' frames as HF's Gemma4VideoProcessor gives them to the model: pixel_values_videos [frames,
        max_patches, ps * ps * 3] (each frame an image of the video budget, normalized as its torchvision backend
        does), video_position_ids, num_frames_per_video."""
        import torch

        from ray_mmbatch.models.hf_common import normalize_video_patches

        frames = grids[:, 0]
        per_frame = torch.repeat_interleave(torch.cat([torch.ones_like(frames)[:, None], grids[:, 1:]], 1), frames, 0)
        dtype = self.hf.model.vision_tower.patch_embedder.input_proj.weight.dtype
        pixels, positions = tower_inputs(normalize_video_patches(patches, self.video_mean, self.video_std), per_frame,
                                         self.ps, self.merge, self.video_max_patches, dtype)
        return {"pixel_values_videos": pixels, "video_position_ids": positions, "num_frames_per_video": frames}

    def packed_masks(self, batch: dict, mm_token_type_ids) -> dict:
        """{layer type: mask} of one packed row: causal AND same sample (full); AND the window, OR'd with the
        image blocks before the ANDs (sliding, when the checkpoint's image blocks are bidirectional)."""
        import torch

        (and_masks, blockwise_overlay, create_causal_mask, packed_sequence_mask_function, sliding_window_overlay,
         get_block_sequence_ids_for_mask) = _mask_api()
        ids = batch["input_ids"]
        lens = torch.as_tensor(batch["seq_lens"], device=ids.device).long()
        sample = torch.repeat_interleave(torch.arange(len(lens), device=ids.device), lens)[None]
        dtype = self.hf.get_input_embeddings().weight.dtype  # what HF's own path builds its mask for
        shape_only = torch.empty((1, ids.shape[1], 1), dtype=dtype, device=ids.device)
        same_sample = packed_sequence_mask_function(sample)

        def mask(or_mask=None, *extra):
            return create_causal_mask(config=self.text_config, inputs_embeds=shape_only, attention_mask=None,
                                      cache=None, position_ids=None, or_mask_function=or_mask,
                                      and_mask_function=and_masks(same_sample, *extra))

        out = {"full_attention": mask()}
        if "sliding_attention" in self.text_config.layer_types:
            blocks = get_block_sequence_ids_for_mask(mm_token_type_ids, device=ids.device)  # unique over the row
            out["sliding_attention"] = mask(blockwise_overlay(blocks) if self.bidirectional else None,
                                            sliding_window_overlay(self.text_config.sliding_window))
        return out


def _mask_api() -> tuple:
    """The transformers mask builders the packed masks use (hf_common.packed_mask_api)."""
    from ray_mmbatch.models.hf_common import packed_mask_api

    return packed_mask_api("gemma4")


def tower_and_embedder(hf_model) -> list:
    """Gemma 4's vision modules: the vision tower and its embedder into the language model."""
    return [hf_model.model.vision_tower, hf_model.model.embed_vision]


def vision_modules(model) -> list:
    """The vision tower and embedder of the HFModel: a batch without images does not run them."""
    return model.vision_modules()


def freeze_unused(hf_model) -> int:
    """requires_grad=False on the audio tower and its embedder (no audio is trained here, so they never reach the
    loss and DDP would see unused weights); returns the number of frozen weights."""
    from ray_mmbatch.models.hf_common import freeze

    return freeze(getattr(hf_model.model, "audio_tower", None), getattr(hf_model.model, "embed_audio", None))


def create_model(cfg, ids: dict):
    """The checkpoint in fp32 wrapped in HFModel with the Gemma 4 adapter; tokenizer ids checked against it."""
    from ray_mmbatch.models.hf_common import load_checked, wrap

    impl = cfg.model.attn_implementation
    if "flash" in impl:
        raise ValueError(f"model.attn_implementation={impl!r}: {_NO_FLASH}")
    hf = load_checked(cfg, ids, "sdpa" if impl == "auto" else impl)
    _check_model(hf.config, cfg.model.path)
    vision = hf.config.vision_config
    want = {"resize": "budget", "patch_size": vision.patch_size, "merge_size": vision.pooling_kernel_size}
    for key, value in want.items():
        if getattr(cfg.image, key) != value:
            raise ValueError(f"image.{key} is {getattr(cfg.image, key)!r} but the model's is {value!r}: "
                             "call configure(cfg) before create_model")
    _mask_api()  # fail here, not at the first packed batch
    freeze_unused(hf)
    return wrap(hf, cfg, Gemma4Adapter(hf, cfg.image), tower_and_embedder, NAME)
