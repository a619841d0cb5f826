"""InternVL backend: configure() from a checkpoint, pixels / ids as HF's, packed and padded batches exact.

The reference is HF's own path, one sample at a time: the chat template's render with every
``<IMG_CONTEXT>`` replaced as ``InternVLProcessor.replace_image_token`` replaces it, tokenized by
the checkpoint's tokenizer, ``pixel_values`` from the checkpoint's PIL GotOcr2 image processor
with ``crop_to_patches=True`` (what InternVLProcessor passes; the processor itself needs
torchvision in transformers 5.25, so its two halves are called separately), fed to
``InternVLForConditionalGeneration(input_ids, pixel_values, attention_mask=ones)`` -> logits ->
shifted CE. Our side is the pipeline's: raw rows -> measure_batch -> materialize_sample ->
collate_pack / collate_pad -> HFModel.target_ce. A tiny random checkpoint with
initializer_range 0.2 makes a wrong mask, wrong positions or tiles given to the wrong sample
move the loss by far more than the tolerance (the controls below). What the family modules
share: tests/family_harness.py.
"""
from __future__ import annotations

import io
import json
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image import image_grid, probe_image
from ray_mmbatch.models import internvl
from tests import family_harness as h
from tests.family_harness import collate, png
from tests.hf_internvl_checkpoint import make_internvl_checkpoint

TILE, PS, MAX_TILES = 56, 14, 6
N = (TILE // PS) ** 2 // 4  # LM tokens per tile (pixel shuffle 0.5)

# no image, one wide (2x... tiles + thumbnail), a thin one (max tiles + thumbnail) with a square one (1 tile), a
# 1x1 one (1 tile)
SPECS = h.tiled_specs((3, 500), TILE, "One grey pixel, blown up to a whole tile.")


ckpt, cfg, tok, model, reference, tol = h.family_fixtures(
    internvl, lambda d: make_internvl_checkpoint(d, tile=TILE, max_patches=MAX_TILES))


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil.from_pretrained(str(ckpt))


def _hf_inputs(tok, processor, user: str, answer: str, pics: list) -> dict:
    """HF InternVL processor's input_ids and pixel_values for one conversation, its two halves called apart."""
    from transformers import InternVLProcessor

    text = h.chat_text(tok, user, answer, len(pics))
    pixels = None
    if pics:
        out = processor(pics, crop_to_patches=True, return_tensors="pt")  # InternVLProcessor's images_kwargs
        pixels, inputs = out["pixel_values"], {"num_patches": out["num_patches"].tolist()}
        proc = SimpleNamespace(start_image_token=tok.start_image_token, end_image_token=tok.end_image_token,
                               image_token=tok.context_image_token, image_seq_length=N)
        text = h.splice(text, tok.context_image_token,
                        [InternVLProcessor.replace_image_token(proc, inputs, i) for i in range(len(pics))])
    return {"input_ids": tok(text).input_ids, "pixel_values": pixels}


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    """Samples through the pipeline's data path, with each one's HF processor inputs."""
    samples, measured, decoded = h.through_the_data_path(h.spec_rows(SPECS), cfg, tok)
    return samples, [_hf_inputs(tok, processor, u, a, d) for (u, a, _), d in zip(SPECS, decoded)], measured


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(built, cfg, processor, tok):
    samples, hf, measured = built
    for s, inputs, (_, _, sizes) in zip(samples, hf, SPECS):
        assert s["input_ids"].tolist() == inputs["input_ids"]  # <img> <IMG_CONTEXT> * tiles * N </img>
        tiles = [processor.get_number_of_image_patches(hh, w, {"crop_to_patches": True}) for w, hh in sizes]
        assert s["grids"].tolist() == [[1, t * TILE // PS, TILE // PS] for t in tiles]
        assert int((s["input_ids"] == tok.convert_tokens_to_ids("<IMG_CONTEXT>")).sum()) == sum(tiles) * N
        pixels = inputs["pixel_values"]
        if pixels is None:
            assert len(s["patches"]) == 0
            continue
        ours = internvl.pixel_values(torch.as_tensor(s["patches"]), s["grids"], TILE, PS, 2, cfg.image.image_mean,
                                     cfg.image.image_std)
        assert ours.shape == pixels.shape
        assert (ours - pixels).abs().max().item() < 1e-5
    assert list(measured[S.TOKENS]) == [len(inputs["input_ids"]) for inputs in hf]
    assert [len(sizes) for *_, sizes in SPECS] == list(measured[S.N_IMAGES])


@pytest.mark.parametrize("size", [(1, 2), (2, 1), (3, 3), (2, 3), (4, 3), (3, 500), (500, 3), (57, 113),
                                  (200, 199), (1000, 10), (7, 1399), (333, 111), (600, 600), (1, 199)])
@pytest.mark.parametrize("max_tiles", [1, 6, 12])
def test_tiles_equal_hf_for_thin_and_extreme_aspect_images(processor, size, max_tiles):
    """Header-only tile count and decoded tiles vs the PIL GotOcr2 processor with crop_to_patches (uint8, exact)."""
    w, hh = size
    icfg = ImageConfig(resize="tiles", image_size=TILE, patch_size=PS, merge_size=2, max_tiles=max_tiles)
    data = png(h.image(w, hh, w * 31 + hh))
    grid = image_grid(*probe_image(data, icfg), icfg)
    hf = processor(Image.open(io.BytesIO(data)), crop_to_patches=True, max_patches=max_tiles, do_rescale=False,
                   do_normalize=False, return_tensors="np")
    assert grid[1] // (TILE // PS) == int(hf["num_patches"][0])
    h.assert_decoded_as_hf(data, grid, icfg, TILE, hf["pixel_values"])


def test_beyond_max_aspect_is_skipped_with_a_reason():
    h.assert_extreme_aspect_skipped(ImageConfig(resize="tiles", image_size=TILE, patch_size=PS, merge_size=2,
                                                max_tiles=MAX_TILES))


# ------------------------------------------------------------------ exactness
test_batch_equals_each_sample_alone = h.exactness_test()


def _tiles_in_reverse_sample_order(batch: dict) -> torch.Tensor:
    """The batch's pixel_values with each sample's block of tiles kept but the samples' order reversed: the
    tile count per sample ignored, as a sampler that slices the flat tile list by sample gets it wrong."""
    tiles = internvl.tiles_per_image(batch["image_grid_thw"], TILE, PS)
    per_sample = torch.zeros(len(batch["sample_ids"]), dtype=torch.long).index_add_(
        0, batch["image_sample_index"].long(), tiles.long())
    blocks = list(torch.split(torch.arange(int(tiles.sum())), per_sample.tolist()))
    return torch.cat(blocks[::-1])


@pytest.mark.parametrize("naive", ["positions_not_restarting", "all_ones_mask", "tiles_without_sample_boundaries"])
def test_naive_packing_is_caught(model, built, reference, tok, tol, naive):
    """The tolerance is meaningful: a naive packed row, or tiles given to the wrong samples, move the CE by more
    than 100 x it (none of them is refused)."""
    batch = collate("pack", built[0], tok.pad_token_id)
    kwargs = h.naive_inputs(model, batch, naive)
    if naive == "tiles_without_sample_boundaries":
        kwargs["pixel_values"] = kwargs["pixel_values"][_tiles_in_reverse_sample_order(batch)]
    h.check_caught(model, batch, kwargs, reference[0], naive, tol)


test_text_only_batch_and_every_weight_gets_a_gradient = h.text_only_test()


# ------------------------------------------------------------------ explicit varlen metadata (flash attention)
def _text_config(hf_model):
    return hf_model.model.language_model.config


# both decoder layers get the packed row's varlen kwargs (InternViT stays on sdpa: its own config)
test_varlen_kwargs_reach_the_attention_call = h.flash_varlen_test(_text_config)
test_varlen_kwargs_only_for_flash_implementations = h.varlen_kwargs_test(_text_config)


# ------------------------------------------------------------------ configure
_configure = partial(h.configure, internvl)


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.min_tiles, im.max_tiles) == \
        ("tiles", TILE, PS, 2, 1, MAX_TILES)
    assert im.image_mean == pytest.approx((0.485, 0.456, 0.406))
    assert im.image_std == pytest.approx((0.229, 0.224, 0.225))
    assert (cfg.text.tokenizer, cfg.text.image_token) == (str(ckpt), "<IMG_CONTEXT>")
    assert tuple(cfg.text.image_block) == ("<IMG_CONTEXT>", "<img><IMG_CONTEXT></img>")
    fewer = _configure(ckpt, **{"image.max_tiles": 2})  # the tile bound is the user's to choose
    assert fewer.image.max_tiles == 2
    assert _configure(ckpt, **{"image.image_size": TILE, "text.image_token": "<IMG_CONTEXT>"}).image.resize == "tiles"


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(internvl, [
    ("image.merge_size", 4), ("image.image_size", 448), ("image.patch_size", 16), ("image.image_mean", "0.5,0.5,0.5"),
    ("text.image_token", "<img>"), ("image.resize", "fixed")])


@pytest.mark.parametrize("config,pre,vision,match", [
    ({"vision_feature_select_strategy": "full"}, None, None, "vision_feature_select_strategy='full'"),
    ({"vision_feature_layer": -2}, None, None, "vision_feature_layer=-2"),
    (None, {"size": {"height": 28, "width": 28}}, None, "vision tower takes 56"),
    (None, {"size": {"height": 56, "width": 28}}, None, "not a square tile size"),
    (None, {"resample": 2}, None, "bicubic"),
    (None, {"image_processor_type": "CLIPImageProcessor"}, None, "GotOcr2"),
    (None, {"min_patches": 7}, None, "min_patches 7"),
    ({"image_seq_length": 256}, None, None, None),  # config.json's is not the processor's: processor_config.json wins
    (None, None, {"patch_size": [16, 16]}, "not a whole number"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, vision, match):
    if match is None:
        assert _configure(h.variant(ckpt, tmp_path, config=config)).image.resize == "tiles"
        return
    h.assert_refuses(internvl, h.variant(ckpt, tmp_path, config=config, pre=pre, vision=vision), match)


def test_configure_refuses_a_processor_token_count_that_is_not_the_tiles(ckpt, tmp_path):
    d = h.variant(ckpt, tmp_path)
    (d / "processor_config.json").write_text(json.dumps({"image_seq_length": N + 1}))
    h.assert_refuses(internvl, d, f"image_seq_length {N + 1}")


test_configure_refuses_other_model_types_and_no_path = h.other_model_types_test(internvl, "InternVL")


def test_create_model_refuses_a_foreign_image_token(cfg, tok):
    with pytest.raises(ValueError, match="image_token_id"):
        internvl.create_model(cfg, h.token_ids(cfg, tok) | {"image_token_id": tok.convert_tokens_to_ids("<img>")})


def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    again = h.check_export(internvl, model, cfg, collate("pack", [built[0][1]], 0), tmp_path)
    assert (again.image.resize, again.image.max_tiles, again.text.image_block) == \
        ("tiles", MAX_TILES, cfg.text.image_block)


test_registry_finds_the_backend = h.registry_test(internvl)
test_verify_packing_job_through_the_data_path = h.verify_packing_test(internvl, 1024)
test_fsdp_units_are_the_decoder_layers_and_vision_is_apart = h.fsdp_units_test(
    internvl, "Qwen2DecoderLayer", lambda hf: hf.model.vision_tower.encoder.layer[0])
