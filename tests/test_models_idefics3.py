"""Idefics3 / SmolVLM backend: configure() from a checkpoint, pixels / ids as HF's, packed and padded batches exact.

The reference is HF's own path, one sample at a time: the chat template's render with every
``<image>`` replaced as the processor replaces it (``get_image_prompt_string`` of the image's rows and
cols: the split block, or the one-view block without splitting),
tokenized by the checkpoint's tokenizer, ``pixel_values`` / ``pixel_attention_mask`` from the
checkpoint's PIL image processor (the processor itself needs torchvision and num2words in
transformers 5.25, so its two halves are called separately), fed to
``*ForConditionalGeneration(input_ids, pixel_values, pixel_attention_mask, attention_mask=ones)`` ->
logits -> shifted CE. Our side is the pipeline's: raw rows -> measure_batch -> materialize_sample ->
collate_pack / collate_pad -> HFModel.target_ce. Both model types run it: smolvlm with image splitting
(resize='split', the checkpoints' default), idefics3 without (resize='global'). What the family
modules share: tests/family_harness.py.
"""
from __future__ import annotations

import io
import json
from functools import partial

import pytest
import torch
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, ImageConfig
from ray_mmbatch.data.image import image_grid, probe_image
from ray_mmbatch.models import idefics3
from tests import family_harness as h
from tests.family_harness import collate, png
from tests.hf_idefics3_checkpoint import make_idefics3_checkpoint

SIDE, PS, TILES = 48, 8, 4
N = (SIDE // PS) ** 2 // 4  # LM tokens per view (pixel shuffle 2)

# no image, a wide one, a thin one with a square one, a 1x1 one (blown up to the whole view)
SPECS = h.tiled_specs((3, 500), SIDE, "One grey pixel, blown up to a whole view.")


def _make_checkpoint(d, param: tuple[str, bool]):
    model_type, splitting = param
    return make_idefics3_checkpoint(d, model_type, side=SIDE, tiles=TILES, splitting=splitting)


# every test on both model types: smolvlm with image splitting, idefics3 without
ckpt, cfg, tok, model, reference, tol = h.family_fixtures(idefics3, _make_checkpoint, params=[("smolvlm", True),
                                                                                      ("idefics3", False)],
                                                     ids=["smolvlm-split", "idefics3-global"])


def _splitting(ckpt) -> bool:
    return bool(json.loads((ckpt / "preprocessor_config.json").read_text())["do_image_splitting"])


def _pil_class(model_type: str):
    """The PIL image processor class of the model type (SmolVLM's is generated from Idefics3's, not the same file)."""
    if model_type == "smolvlm":
        from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil

        return SmolVLMImageProcessorPil
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil


def _pil_processor(path):
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    return _pil_class(model_type).from_pretrained(str(path))


@pytest.fixture(scope="module")
def processor(ckpt):
    return _pil_processor(ckpt)


def _hf_inputs(tok, processor, user: str, answer: str, pics: list) -> tuple[dict, list[int]]:
    """HF processor's (input_ids, pixel_values, pixel_attention_mask) for one conversation, halves called apart;
    and the views of each image."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    text = h.chat_text(tok, user, answer, len(pics))
    inputs, views = {"pixel_values": None, "pixel_attention_mask": None}, []
    if pics:
        out = processor(pics, return_tensors="pt", return_row_col_info=True)
        inputs = {k: out[k] for k in inputs}
        grid = list(zip(out["rows"][0], out["cols"][0]))
        views = [r * c + 1 if r else 1 for r, c in grid]
        text = h.splice(text, "<image>", [get_image_prompt_string(r, c, N, "<fake_token_around_image>", "<image>",
                                                                  "<global-img>") for r, c in grid])
    return {"input_ids": tok(text).input_ids, **inputs}, views


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    """Samples through the pipeline's data path, with each one's HF processor inputs (and views per image)."""
    samples, measured, decoded = h.through_the_data_path(h.spec_rows(SPECS), cfg, tok)
    hf, views = zip(*(_hf_inputs(tok, processor, u, a, d) for (u, a, _), d in zip(SPECS, decoded)))
    return samples, list(hf), measured, list(views)


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(built, cfg, tok, ckpt):
    from ray_mmbatch.models.internvl import pixel_values

    samples, hf, measured, views_per_sample = built
    image_id = tok.convert_tokens_to_ids("<image>")
    assert cfg.image.resize == ("split" if _splitting(ckpt) else "global")
    for s, inputs, views in zip(samples, hf, views_per_sample):
        assert s["input_ids"].tolist() == inputs["input_ids"]  # the processor's blocks (rows of views, global view)
        assert s["grids"].tolist() == [[1, v * SIDE // PS, SIDE // PS] for v in views]
        assert int((s["input_ids"] == image_id).sum()) == sum(views) * N
        if inputs["pixel_values"] is None:
            assert len(s["patches"]) == 0
            continue
        assert bool(inputs["pixel_attention_mask"].all())  # no view is padded inside
        ours = pixel_values(torch.as_tensor(s["patches"]), s["grids"], SIDE, PS, 2, cfg.image.image_mean,
                            cfg.image.image_std)
        assert ours[None].shape == inputs["pixel_values"].shape
        assert (ours[None] - inputs["pixel_values"]).abs().max().item() < 1e-5
    assert list(measured[S.TOKENS]) == [len(inputs["input_ids"]) for inputs in hf]
    assert [len(sizes) for *_, sizes in SPECS] == list(measured[S.N_IMAGES])
    # the 1x1 image: the full grid
    assert max(v for views in views_per_sample for v in views) == (TILES * TILES + 1 if _splitting(ckpt) else 1)


@pytest.mark.parametrize("size", [(1, 1), (1, 2), (3, 3), (2, 3), (3, 500), (500, 3), (57, 113), (1000, 10),
                                  (7, 1399), (333, 111), (1, 199), (5000, 40), (49, 48), (96, 95), (145, 97)])
@pytest.mark.parametrize("tiles,splitting", [(1, True), (3, True), (4, False)])
@pytest.mark.parametrize("model_type", ["smolvlm", "idefics3"])
def test_views_equal_hf_for_thin_and_extreme_aspect_images(size, tiles, splitting, model_type):
    """Header-only grid and decoded views vs the PIL SmolVLM / Idefics3 processor (uint8, exact), every resize."""
    from ray_mmbatch.data.image import split_grid

    w, hh = size
    processor = _pil_class(model_type)(size={"longest_edge": tiles * SIDE}, max_image_size={"longest_edge": SIDE},
                                       do_image_splitting=splitting, resample=1)
    icfg = ImageConfig(resize="split" if splitting else "global", image_size=SIDE, patch_size=PS, merge_size=2,
                       max_tiles=tiles)
    data = png(h.image(w, hh, w * 31 + hh))
    hw = probe_image(data, icfg)
    grid = image_grid(*hw, icfg)
    hf = processor(Image.open(io.BytesIO(data)), do_rescale=False, do_normalize=False, return_tensors="np",
                   return_row_col_info=True)
    rows, cols = hf["rows"][0][0], hf["cols"][0][0]
    if splitting:
        assert split_grid(*hw, icfg) == (rows, cols)
    assert tuple(grid) == (1, (rows * cols + 1 if rows else 1) * SIDE // PS, SIDE // PS)
    h.assert_decoded_as_hf(data, grid, icfg, SIDE, hf["pixel_values"], batched=True)


def test_beyond_max_aspect_is_skipped_with_a_reason():
    h.assert_extreme_aspect_skipped(ImageConfig(resize="global", image_size=SIDE, patch_size=PS, merge_size=2,
                                                max_tiles=TILES))


# ------------------------------------------------------------------ exactness
test_batch_equals_each_sample_alone = h.exactness_test()


@pytest.mark.parametrize("naive", ["positions_not_restarting", "all_ones_mask", "images_in_reverse_order"])
def test_naive_packing_is_caught(model, built, reference, tok, tol, naive):
    """The tolerance is meaningful: a naive packed row, or images given to the wrong samples, move the CE by more
    than 100 x it (none of them is refused)."""
    batch = collate("pack", built[0], tok.pad_token_id)
    kwargs = h.naive_inputs(model, batch, naive)
    if naive == "images_in_reverse_order":
        kwargs["pixel_values"] = kwargs["pixel_values"].flip(1)
    h.check_caught(model, batch, kwargs, reference[0], naive, tol)


test_text_only_batch_and_every_weight_gets_a_gradient = h.text_only_test()
test_varlen_kwargs_for_flash_implementations_only = h.varlen_kwargs_test(lambda hf: hf.model.text_model.config)


def test_varlen_kwargs_reach_the_attention_call(model, tok, built, reference, ckpt, tol):
    """On a flash-named implementation the packed row's cu_seq_lens / max_length reach every decoder layer's
    attention call, and running on them alone is exact (the vision tower keeps its own sdpa)."""
    if not _splitting(ckpt):
        pytest.skip("the adapter is the same with and without splitting: one checkpoint is enough")
    pack, pad = (collate(mode, built[0], tok.pad_token_id) for mode in ("pack", "pad"))
    h.check_flash_varlen(model, model.hf_model.model.text_model.config, pack, pad, reference[0], tol)


# ------------------------------------------------------------------ configure
_configure = partial(h.configure, idefics3)


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    mode = "split" if _splitting(ckpt) else "global"
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.max_tiles) == (mode, SIDE, PS, 2, TILES)
    assert im.image_mean == pytest.approx((0.5, 0.5, 0.5)) and im.image_std == pytest.approx((0.5, 0.5, 0.5))
    assert (cfg.text.tokenizer, cfg.text.image_token) == (str(ckpt), "<image>")
    assert tuple(cfg.text.image_block) == ("<image>", "<fake_token_around_image><global-img><image>"
                                                      "<fake_token_around_image>")


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(idefics3, [
    ("image.merge_size", 4), ("image.image_size", 64), ("image.patch_size", 16), ("image.image_mean", "0.4,0.4,0.4"),
    ("text.image_token", "<global-img>"), ("image.resize", "fixed")])


def test_splitting_from_the_checkpoint_global_on_request(ckpt, tmp_path):
    split = h.variant(ckpt, tmp_path, pre={"do_image_splitting": True})
    assert _configure(split).image.resize == "split"
    c = _configure(split, **{"image.resize": "global"})  # HF's processor with do_image_splitting=False
    assert c.image.resize == "global" and c.image.max_tiles == TILES
    (tmp_path / "plain").mkdir()
    plain = h.variant(ckpt, tmp_path / "plain", pre={"do_image_splitting": False})
    with pytest.raises(ValueError, match=r"image.resize = .*split.*contradicts the checkpoint"):
        _configure(plain, **{"image.resize": "split"})


def test_max_tiles_is_the_users_to_lower_and_stays_hf_exact(ckpt):
    """image.max_tiles = HF's processor called with size={'longest_edge': max_tiles * S}: fewer views."""
    c = _configure(ckpt, **{"image.max_tiles": 2})
    assert c.image.max_tiles == 2
    data = png(h.image(170, 45, 3))
    grid = image_grid(*probe_image(data, c.image), c.image)
    hf = _pil_processor(ckpt)(Image.open(io.BytesIO(data)), size={"longest_edge": 2 * SIDE}, do_rescale=False,
                              do_normalize=False, return_tensors="np")
    h.assert_decoded_as_hf(data, grid, c.image, SIDE, hf["pixel_values"], batched=True)


def test_splitting_needs_the_row_col_tokens_of_its_grid(ckpt, tmp_path):
    """7 x 7 views need <row_7_col_1>...: the tokenizer has them up to 6 (as the real ones), so refused."""
    h.assert_refuses(idefics3, h.variant(ckpt, tmp_path, pre={"do_image_splitting": True,
                                                               "size": {"longest_edge": 7 * SIDE}}),
                     r"no tokens \['<row_1_col_7>'")


@pytest.mark.parametrize("config,pre,vision,match", [
    (None, {"max_image_size": {"longest_edge": 32}}, None, "vision tower takes 48"),
    (None, {"size": {"longest_edge": 100}}, None, "not a multiple of max_image_size"),
    (None, {"size": {"height": 96, "width": 96}}, None, "longest_edge"),
    (None, {"resample": 3}, None, "Lanczos"),
    (None, {"image_processor_type": "CLIPImageProcessor"}, None, "Idefics3ImageProcessor"),
    (None, {"do_normalize": False}, None, "padding image"),
    (None, {"image_mean": [0.0, 0.0, 0.0]}, None, "padding image"),
    (None, None, {"patch_size": 10}, "not a whole number"),
    ({"model_type": "llava"}, None, None, "not Idefics3"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, vision, match):
    h.assert_refuses(idefics3, h.variant(ckpt, tmp_path, config=config, pre=pre, vision=vision), match)


def test_configure_refuses_a_processor_token_count_that_is_not_the_view(ckpt, tmp_path):
    d = h.variant(ckpt, tmp_path)
    (d / "processor_config.json").write_text(json.dumps({"image_seq_len": N + 1}))
    h.assert_refuses(idefics3, d, f"image_seq_len {N + 1}")
    with pytest.raises(ValueError, match="model.path"):
        idefics3.configure(Config())


def test_export_round_trip_and_registry(model, cfg, built, tmp_path, ckpt):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    again = h.check_export(idefics3, model, cfg, collate("pack", [built[0][1]], 0), tmp_path)
    assert (again.image.resize, again.image.max_tiles, again.text.image_block) == \
        (cfg.image.resize, TILES, cfg.text.image_block)
    h.check_registry(ckpt, "idefics3")
    h.check_fsdp_units(idefics3, model, "LlamaDecoderLayer", model.hf_model.model.vision_model.encoder.layers[0])


def test_verify_packing_job_through_the_data_path(ckpt, tmp_path_factory, capsys, tol):
    """jobs/verify_packing.py on generated data (its image sizes and conversations): exact, and real packs
    (pack mode with splitting, pad mode without: both modes are exact for both above)."""
    mode = "pack" if _splitting(ckpt) else "pad"
    report = h.verify_packing(ckpt, h.generated_data(tmp_path_factory, "idefics3_verify_data"), mode, 1024, capsys,
                              tol)
    # a real pack among the first three batches (which ones come first is the seeded sample order's)
    assert mode == "pad" or report["samples"] > report["batches"]
