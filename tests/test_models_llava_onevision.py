"""LLaVA-OneVision backend: configure() from a checkpoint, pixels / ids as HF's, packed and padded batches exact.

The reference is HF's own path, one sample at a time: the chat template's render with every ``<image>``
replaced as ``LlavaOnevisionProcessor.replace_image_token`` replaces it (the processor's own method, on an
instance built without its video processor: in transformers 5.25 the processor needs torchvision),
tokenized by the checkpoint's tokenizer; ``pixel_values``, ``image_sizes`` and ``batch_num_images`` from
the checkpoint's PIL image processor given the sample's images as one nested list; fed to
``LlavaOnevisionForConditionalGeneration(input_ids, pixel_values, image_sizes, batch_num_images,
attention_mask=ones)`` -> logits -> shifted CE. Our side is the pipeline's: raw rows -> measure_batch ->
materialize_sample -> collate_pack / collate_pad -> HFModel.target_ce. A tiny random checkpoint with
initializer_range 0.2 makes a wrong mask, wrong positions, or the wrong image_sizes / batch_num_images move
the loss by far more than the tolerance (the controls below). What the family modules share:
tests/family_harness.py.
"""
from __future__ import annotations

import io
from functools import partial

import numpy as np
import pytest
import torch
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.batching.collate import collate_pack, collate_pad
from ray_mmbatch.data.image import decode_image, image_grid, image_tokens, probe_image
from ray_mmbatch.models import llava_onevision as ov
from tests import family_harness as h
from tests.family_harness import collate, png
from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

TILE, PS = 42, 14
G = TILE // PS

# no image; a wide one (anyres, pooled); two in one sample (base tiles only: a thin line and a square); a 1x1 one
# (anyres); a tall one (anyres, unpadded)
SPECS = [*h.tiled_specs((3, 100), TILE, "One grey pixel."),
         ("<image>\nAnd this one?", "A tall noisy page.", [(61, 150)])]


ckpt, cfg, tok, model, reference, tol = h.family_fixtures(ov, lambda d: make_llava_onevision_checkpoint(d, tile=TILE))


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import LlavaOnevisionImageProcessorPil

    return LlavaOnevisionImageProcessorPil.from_pretrained(str(ckpt))


def _hf_processor(processor, anyres_max: int = 2):
    """LlavaOnevisionProcessor without its video processor (torchvision): its token-count methods only."""
    from transformers import LlavaOnevisionProcessor

    p = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    p.image_processor, p.num_image_tokens, p.image_token = processor, G * G, "<image>"
    p.vision_feature_select_strategy, p.vision_aspect_ratio = "full", f"anyres_max_{anyres_max}"
    return p


def _hf_inputs(tok, processor, user: str, answer: str, pics: list) -> dict:
    """HF LLaVA-OneVision processor's input_ids and image inputs for one conversation."""
    text = h.chat_text(tok, user, answer, len(pics))
    inputs = {}
    if pics:
        out = processor([pics], return_tensors="pt")  # one sample: batch_num_images = [len(pics)]
        inputs = {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images")}
        proc = _hf_processor(processor)
        text = h.splice(text, "<image>", [proc.replace_image_token(inputs, i) for i in range(len(pics))])
    return {"input_ids": tok(text).input_ids, **inputs}


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    """Samples through the pipeline's data path, with each one's HF processor inputs."""
    samples, measured, decoded = h.through_the_data_path(h.spec_rows(SPECS), cfg, tok)
    return samples, [_hf_inputs(tok, processor, u, a, d) for (u, a, _), d in zip(SPECS, decoded)], measured


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(built, cfg, tok):
    samples, hf, measured = built
    image_id = tok.convert_tokens_to_ids("<image>")
    for s, inputs, (_, _, sizes) in zip(samples, hf, SPECS):
        assert s["input_ids"].tolist() == inputs["input_ids"]  # one contiguous run of <image> per image
        if not sizes:
            assert len(s["patches"]) == 0 and "image_sizes" in s and len(s["image_sizes"]) == 0
            continue
        assert s["image_sizes"].tolist() == inputs["image_sizes"].tolist() == [[hh, w] for w, hh in sizes]
        want = sum(image_tokens(g, hw, cfg.image) for g, hw in zip(s["grids"], s["image_sizes"]))
        assert int((s["input_ids"] == image_id).sum()) == want
        ours = ov.pixel_values(torch.as_tensor(s["patches"]), TILE, cfg.image.image_mean, cfg.image.image_std)
        theirs = inputs["pixel_values"].flatten(0, 1)
        n_real = [int(g[1]) for g in s["grids"]]  # HF pads every image to the most crops of the call: drop them
        keep = torch.cat([torch.arange(i * inputs["pixel_values"].shape[1], i * inputs["pixel_values"].shape[1] + n)
                          for i, n in enumerate(n_real)])
        assert ours.shape == theirs[keep].shape
        assert (ours - theirs[keep]).abs().max().item() < 1e-5
    assert list(measured[S.TOKENS]) == [len(inputs["input_ids"]) for inputs in hf]


SIZES = [(1, 2), (2, 1), (3, 3), (2, 3), (4, 3), (3, 500), (500, 3), (57, 113), (200, 199), (1000, 10), (7, 1399),
         (333, 111), (600, 600), (1, 199), (43, 41), (85, 42), (170, 45)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("n_images", [1, 2])
def test_tiles_and_tokens_equal_hf_for_thin_and_extreme_aspect_images(cfg, processor, size, n_images):
    """Header-only tile and token counts and decoded tiles vs the PIL processor (uint8, exact) and
    LlavaOnevisionProcessor's token count, for a sample's only image and for one of several."""
    w, hh = size
    icfg = cfg.image
    data = png(h.image(w, hh, w * 31 + hh))
    hw = probe_image(data, icfg)
    grid = image_grid(*hw, icfg, n_images=n_images)
    img = Image.open(io.BytesIO(data))
    other = Image.new("RGB", (5, 5))
    hf = processor([[img] + [other] * (n_images - 1)], do_rescale=False, do_normalize=False, return_tensors="np")
    n = int(grid[1])
    assert n == (1 if n_images > 1 else 1 + int(np.any(hf["pixel_values"][0, 1:] != 0, axis=(1, 2, 3)).sum()) or n)
    h.assert_decoded_as_hf(data, grid, icfg, TILE, hf["pixel_values"][0, :n])
    assert not hf["pixel_values"][0, n:].any()  # HF's batch padding only beyond our tiles
    text = _hf_processor(processor).replace_image_token(
        {k: hf[k] for k in ("image_sizes", "batch_num_images", "pixel_values")}, 0)
    assert image_tokens(grid, hw, icfg) == text.count("<image>")


@pytest.mark.parametrize("anyres_max", [1, 9])
def test_token_count_follows_anyres_max(cfg, processor, anyres_max):
    from dataclasses import replace

    icfg = replace(cfg.image, anyres_max=anyres_max)
    proc = _hf_processor(processor, anyres_max)
    for w, hh in SIZES:
        grid = image_grid(hh, w, icfg)
        want = proc._get_number_of_features(hh, w, TILE, TILE)
        assert image_tokens(grid, (hh, w), icfg) == want, (w, hh)


def test_beyond_max_aspect_is_skipped_with_a_reason(cfg):
    h.assert_extreme_aspect_skipped(cfg.image)


# ------------------------------------------------------------------ exactness
def _images_per_sample_are_batch_num_images(batch):
    assert ov.images_per_sample(batch) == [len(sz) for *_, sz in SPECS]


test_batch_equals_each_sample_alone = h.exactness_test(_images_per_sample_are_batch_num_images)


def _crops_per_image(batch: dict, pixel_values: torch.Tensor) -> torch.Tensor:
    """The row's flat tiles [n_tiles, 3, S, S] as HF's processor lays them out: [n_images, most tiles, 3, S, S],
    each image's tiles first, zeros after."""
    per_image = torch.split(pixel_values, batch["image_grid_thw"][:, 1].tolist())
    out = pixel_values.new_zeros(len(per_image), max(len(t) for t in per_image), *pixel_values.shape[1:])
    for i, t in enumerate(per_image):
        out[i, :len(t)] = t
    return out


@pytest.mark.parametrize("naive", ["positions_not_restarting", "all_ones_mask", "images_per_row"])
def test_naive_packing_is_caught(model, built, reference, tok, tol, naive):
    """The tolerance is meaningful: a naive packed row moves the CE by more than 100 x it. 'images_per_row':
    batch_num_images counted per packed row instead of per sample, so HF takes every image for one of several
    and keeps its base tile only; the base tile's features cannot fill the anyres image tokens the sample was
    measured with, and HF refuses for exactly that reason (the mistake cannot reach the loss: whichever
    one-image samples share a row, their token counts no longer match)."""
    samples, ref = built[0], reference[0]
    if naive == "images_per_row":  # the row's images share no tiles: only one-image samples, each anyres
        one = [len(s["grids"]) == 1 for s in samples]
        ref = torch.cat([c for c, keep in zip(torch.split(ref, [int((s["labels"] != S.IGNORE_INDEX).sum())
                                                               for s in samples]), one) if keep])
        samples = [s for s, keep in zip(samples, one) if keep]
    batch = collate("pack", samples, tok.pad_token_id)
    kwargs = h.naive_inputs(model, batch, naive)
    if naive != "images_per_row":
        assert h.check_caught(model, batch, kwargs, ref, naive, tol) is not None
        return
    kwargs["batch_num_images"] = [len(samples)]
    # the tiles in HF's processor layout, which HF cuts to each image's base tile: on our flat tiles its split of
    # the features by one tile per image fails in torch (split_with_sizes: more tiles than images) before HF
    # checks anything, an error that says nothing about the mistake
    kwargs["pixel_values"] = _crops_per_image(batch, kwargs["pixel_values"])
    refusal = (ValueError, r"^Image features and image tokens do not match, tokens: \d+, features: \d+$")
    assert h.check_caught(model, batch, kwargs, ref, naive, tol, may_refuse=(refusal,)) is None


test_text_only_batch_and_every_weight_gets_a_gradient = h.text_only_test()


def test_split_batch_keeps_image_sizes(built, tok):
    from ray_mmbatch.batching.layout import split_batch

    samples = built[0]
    for mode in ("pack", "pad"):
        back = split_batch((collate_pack if mode == "pack" else collate_pad)(samples, tok.pad_token_id))
        for a, b in zip(samples, back):
            assert b["image_sizes"].tolist() == a["image_sizes"].tolist()


# both decoder layers get the packed row's varlen kwargs (SigLIP stays on sdpa: its own config)
test_varlen_kwargs_reach_the_attention_call = h.flash_varlen_test(lambda hf: hf.model.language_model.config)


# ------------------------------------------------------------------ configure
_configure = partial(h.configure, ov)


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.anyres_max, im.anyres_features) == \
        ("anyres", TILE, TILE, 1, 2, G)
    assert len(im.grid_pinpoints) == 32
    assert (cfg.text.tokenizer, cfg.text.image_token, tuple(cfg.text.image_block)) == (str(ckpt), "<image>", ())


@pytest.mark.parametrize("config,pre,vision,match", [
    ({"vision_feature_select_strategy": "default"}, None, None, "vision_feature_select_strategy='default'"),
    ({"vision_feature_layer": -2}, None, None, "vision_feature_layer=-2"),
    ({"vision_aspect_ratio": "anyres"}, None, None, "anyres_max_N"),
    ({"image_grid_pinpoints": [[42, 50]]}, None, None, "multiples"),
    (None, {"size": {"height": 28, "width": 28}}, None, "vision tower takes 42"),
    (None, {"resample": 2}, None, "bicubic"),
    (None, {"image_processor_type": "CLIPImageProcessor"}, None, "LlavaOnevision"),
    (None, {"image_grid_pinpoints": [[42, 42]]}, None, "differ"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, vision, match):
    h.assert_refuses(ov, h.variant(ckpt, tmp_path, config=config, pre=pre, vision=vision), match)


test_configure_refuses_other_model_types_and_no_path = h.other_model_types_test(ov, "LLaVA-OneVision")


def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    again = h.check_export(ov, model, cfg, collate("pack", [built[0][1]], 0), tmp_path)
    assert (again.image.resize, again.image.grid_pinpoints) == ("anyres", cfg.image.grid_pinpoints)


test_registry_finds_the_backend = h.registry_test(ov)
test_verify_packing_job_through_the_data_path = h.verify_packing_test(ov, 2048)
test_fsdp_units_are_the_decoder_layers_and_vision_is_apart = h.fsdp_units_test(
    ov, "Qwen2DecoderLayer", lambda hf: hf.model.vision_tower.encoder.layers[0])


def test_fast_decode_keeps_the_tiles_shape(cfg):
    """fast_decode (not HF's pixels) drafts a JPEG no smaller than the best resolution its crops are cut from."""
    from dataclasses import replace

    fast = replace(cfg.image, fast_decode=True)
    for w, hh in [(900, 120), (120, 900), (500, 500)]:
        buf = io.BytesIO()
        h.image(w, hh, 1).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
        for n_images in (1, 2):
            grid = image_grid(*probe_image(data, fast), fast, n_images=n_images)
            exact = decode_image(data, grid, cfg.image).astype(int)
            approx = decode_image(data, grid, fast).astype(int)
            assert approx.shape == exact.shape == (int(grid[1]) * TILE, TILE, 3)
            assert np.abs(approx - exact).mean() < 20  # the same picture, resampled differently
