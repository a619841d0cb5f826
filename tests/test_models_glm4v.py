"""GLM-4.1V / GLM-4.5V backend (issue 45): configure() from a checkpoint, ids / pixels / costs as HF's processor gives
them, packed and padded batches exactly equal to HF run per sample (GLM's own 3-D ``get_rope_index`` per packed
sample), and the naive packed feeds shown to be off.

The reference is HF's own path, one sample at a time: the checkpoint's chat template rendered and expanded by HF's
Glm4vProcessor (its video half left out: HF's GLM video processor needs torchvision), ``pixel_values`` from the
checkpoint's PIL Glm4vImageProcessor, fed to ``Glm4v(Moe)ForConditionalGeneration(input_ids, pixel_values,
image_grid_thw, mm_token_type_ids, attention_mask=ones)`` -> logits -> shifted CE. Our side is the pipeline's: raw
rows -> measure_batch -> materialize_sample -> collate_pack / collate_pad -> HFModel.target_ce. The tiny random
checkpoints (tests/hf_glm4v_checkpoint.py; initializer_range 0.2) make a wrong mask or wrong 3-D positions move the
loss far beyond the tolerance (family_harness.TOLERANCE). Each test runs on the dense and the MoE checkpoint.
What the family modules share: tests/family_harness.py. Video (HF's video processor in the torchvision interpreter):
tests/test_video.py's GLM tests.
"""
from __future__ import annotations

import copy
import json
from functools import partial

import pytest
import torch

from ray_mmbatch.models import glm4v
from ray_mmbatch.models.hf_common import CLIP_MEAN, CLIP_STD, normalize_patches
from tests import family_harness as h
from tests.family_harness import collate
from tests.hf_glm4v_checkpoint import FACTOR, GLM4V_MODEL_TYPES, PATCH, make_glm4v_checkpoint

# text only; a wide image; a thin one (GLM scales a side under 28 px up) with a square one; a 1 x 1 one (scaled up to
# 28 px, then to the 4-token minimum), answered with trailing spaces (the template strips them)
SPECS = h.tiled_specs((9, 150), 64, "Red on grey.  ")

ckpt, cfg, tok, model, reference, tol = h.family_fixtures(  # tol: TOLERANCE["glm4v"] / ["glm4v_moe"]
    glm4v, make_glm4v_checkpoint, params=GLM4V_MODEL_TYPES, ids=list(GLM4V_MODEL_TYPES))

@pytest.fixture(scope="module")
def processor(ckpt):
    from tests import targets_reference as R

    return R.hf_processor(ckpt, "glm4v")


def _hf_inputs(processor, user: str, answer: str, pics: list) -> dict:
    """HF's processor on the sample's chat render: ids, pixel_values, image_grid_thw, mm_token_type_ids."""
    text = h.chat_text(processor.tokenizer, user, answer, len(pics))
    out = processor(text=[text], images=[[p.convert("RGB") for p in pics]] if pics else None, return_tensors="pt")
    kwargs = {"input_ids": out["input_ids"][0].tolist()}
    if pics:
        kwargs.update(pixel_values=out["pixel_values"].float(), image_grid_thw=out["image_grid_thw"],
                      mm_token_type_ids=out["mm_token_type_ids"])
    return kwargs


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    return h.build_specs(SPECS, cfg, tok, partial(_hf_inputs, processor))


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(model, built, cfg, tok):
    """ids (template, image blocks, stripped answers), mm_token_type_ids, grids and pixels equal HF's processor's; the
    cost measured from the image headers before any decode is the processor's token count exactly."""
    h.check_ids_and_costs(built, model.hf_model.config.image_token_id, SPECS)
    for s, inputs in zip(*built[:2]):
        if "pixel_values" in inputs:
            assert s["grids"].tolist() == inputs["image_grid_thw"].tolist()
            ours = model.forward_inputs(collate("pad", [s], tok.pad_token_id))
            assert torch.equal(ours["mm_token_type_ids"], inputs["mm_token_type_ids"].int())
            assert torch.equal(ours["pixel_values"], inputs["pixel_values"])  # bit for bit (rescaled in float64 as HF)
            plain = normalize_patches(torch.as_tensor(s["patches"]), cfg.image.image_mean, cfg.image.image_std, 2)
            assert not torch.equal(plain, inputs["pixel_values"])  # a float32 rescale is 1 ulp off: the check can fail


@pytest.mark.parametrize("bounds", [(2 * 4 * FACTOR ** 2, 2 * 64 * FACTOR ** 2), (12544, 9633792)])
def test_glm_smart_resize_is_hfs_formula(cfg, bounds):
    """data/image/smart.glm_smart_resize against HF's own GLM smart_resize over thin, tiny, odd and large sizes, at the
    tiny checkpoint's bounds and the published ones (size 12544 .. 9633792): the same size, or HF raises and the
    image is skipped (extreme_aspect)."""
    from transformers.models.glm4v.image_processing_pil_glm4v import smart_resize

    from ray_mmbatch.data.image import ImageSkip, glm_smart_resize

    icfg = copy.deepcopy(cfg.image)
    icfg.min_pixels, icfg.max_pixels = bounds
    sides = (1, 2, 3, 5, 9, 13, 27, 28, 29, 45, 100, 101, 599, 640, 1000, 4000, 5599, 6000)
    for hh in sides:
        for ww in sides:
            try:
                want = smart_resize(2, hh, ww, 2, FACTOR, *bounds)
            except ValueError:
                with pytest.raises(ImageSkip):
                    glm_smart_resize(hh, ww, icfg)
                continue
            assert glm_smart_resize(hh, ww, icfg) == want, (hh, ww)


def test_beyond_max_aspect_is_skipped_with_a_reason(cfg):
    h.assert_extreme_aspect_skipped(cfg.image)  # HF's GLM processor refuses aspect ratios over 200


# ------------------------------------------------------------------ exactness and its controls
test_batch_equals_each_sample_alone = h.exactness_test()


def _text_config(hf_model):
    return hf_model.model.language_model.config


def test_pack_is_exact_with_eager_attention(cfg, tok, built, reference, tol):
    """Judged against HF's own path on eager: HF's eager and sdpa paths are 7.6e-6 apart on the MoE checkpoint."""
    h.check_pack_exact_with_eager(glm4v, cfg, tok, built[0], reference, _text_config, tol, built[1])


@pytest.mark.parametrize("naive", ["hf_position_id_packing", "positions_not_restarting", "text_rope_for_images",
                                   "use_cache"])
def test_naive_packed_feeds_are_caught(model, built, reference, tok, tol, naive):
    """Each naive feed of the packed row moves some target token's CE by more than 100 x the tolerance:
    hf_position_id_packing: HF's own position-id packing ([1, T] positions restarting per sample, no 3-D ids of its
    own: GLM then treats the row as one causal sequence) -- by more than 0.1 nats; positions_not_restarting: 1-D
    positions counting on; text_rope_for_images: restarting text positions with the image blocks' 3-D ids left
    1-D (GLM's get_rope_index not run); use_cache: HF stops looking for packed samples."""
    batch = collate("pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    if naive == "hf_position_id_packing":
        kwargs["position_ids"] = batch["position_ids"].long()
    elif naive == "text_rope_for_images":
        kwargs["position_ids"] = batch["position_ids"].long()[None].expand(4, -1, -1)
    else:
        kwargs = h.naive_inputs(model, batch, naive)
    moved = h.check_caught(model, batch, kwargs, reference[0], naive, tol)
    if naive == "hf_position_id_packing":
        assert moved > 0.1


def test_the_loss_is_the_cross_entropy_only_even_with_router_logits_on(model, built, reference, tok, tol):
    """MoE: the training loss of a packed batch is the sum of each sample's CE alone, with the config's
    output_router_logits on too (HF's model class would add router_aux_loss_coef x the balance loss; the backend runs
    the base model and its own loss)."""
    config = model.hf_model.config.get_text_config()
    saved = getattr(config, "output_router_logits", False)
    config.output_router_logits = True
    try:
        with torch.no_grad():
            ce_sum, n = model(collate("pack", built[0], tok.pad_token_id), loss_only=True)
    finally:
        config.output_router_logits = saved
    assert int(n) == reference[0].numel()
    assert abs(float(ce_sum) - float(reference[0].sum())) < tol.ce * int(n)


def test_packed_positions_are_glms_get_rope_index_per_sample(model, built, tok):
    """Rows 1-3 of the packed position ids are GLM's own get_rope_index of each sample alone (an image block's ids
    start at its position; the text after it max(h, w) / merge later); row 0 restarts per sample."""
    samples = built[0]
    batch = collate("pack", samples, tok.pad_token_id)
    pos = model.forward_inputs(batch)["position_ids"]
    base, at = model.hf_model.model, 0
    for s, kw in zip(samples, built[1]):
        n = len(s["input_ids"])
        assert pos[0, 0, at:at + n].tolist() == list(range(n))
        if "image_grid_thw" in kw:
            ids = torch.as_tensor(kw["input_ids"])[None]
            want, _ = base.get_rope_index(ids, kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"])
            assert torch.equal(pos[1:, :, at:at + n], want)
            assert int(want.max()) + 1 < n  # an image block takes fewer positions than tokens
        at += n


test_text_only_batch_and_every_weight_gets_a_gradient = h.text_only_test(0)
test_varlen_kwargs_only_for_flash_implementations = h.varlen_kwargs_test(_text_config)
test_flash_attention_gets_the_varlen_metadata = h.flash_varlen_test(_text_config)


# ------------------------------------------------------------------ configure
_configure = partial(h.configure, glm4v)


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.patch_size, im.merge_size, im.temporal_patch_size) == ("smart_glm", PATCH, 2, 2)
    assert (im.min_pixels, im.max_pixels) == (2 * 4 * FACTOR ** 2, 2 * 64 * FACTOR ** 2)
    assert im.image_mean == pytest.approx(CLIP_MEAN) and im.image_std == pytest.approx(CLIP_STD)
    assert (cfg.text.tokenizer, cfg.text.image_token, cfg.text.chat_template) == (str(ckpt), "<|image|>", "auto")
    vid = cfg.image  # video: the checkpoint's video_preprocessor_config.json (hf_glm4v_checkpoint.VIDEO_PROCESSOR)
    assert (cfg.text.video_token, vid.video, vid.video_sample_frames, vid.video_fps, vid.video_max_duration) == \
        ("<|video|>", "glm4v", True, 3.0, 3.0)
    assert (vid.video_min_pixels, vid.video_max_pixels, vid.video_cap_pixels_per_frame) == \
        (2 * 4 * FACTOR ** 2, 96 * FACTOR ** 2, False)
    assert vid.video_mean == pytest.approx(CLIP_MEAN) and vid.video_std == pytest.approx(CLIP_STD)
    again = glm4v.configure(copy.deepcopy(cfg))
    assert again.image == cfg.image and again.text == cfg.text
    fewer = _configure(ckpt, **{"image.max_pixels": 2 * 16 * FACTOR ** 2})  # the resolution bound: the user's choice
    assert fewer.image.max_pixels == 2 * 16 * FACTOR ** 2


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(glm4v, [
    ("image.patch_size", 16), ("image.merge_size", 4), ("image.image_mean", "0.4,0.4,0.4"), ("image.resize", "budget"),
    ("image.temporal_patch_size", 3), ("text.image_token", "<|begin_of_image|>")])


def test_create_model_refuses_a_foreign_image_token_and_an_unconfigured_resize(cfg, tok):
    with pytest.raises(ValueError, match="image_token_id"):
        glm4v.create_model(cfg, h.token_ids(cfg, tok) | {"image_token_id": tok.convert_tokens_to_ids("<|user|>")})
    smart = copy.deepcopy(cfg)
    smart.image.resize = "smart"
    with pytest.raises(ValueError, match="call configure"):
        glm4v.create_model(smart, h.token_ids(cfg, tok))


@pytest.mark.parametrize("pre,vision,match", [
    ({"patch_size": 16}, None, "patch_size=16 disagrees"),
    ({"temporal_patch_size": 1}, None, "temporal_patch_size=1 disagrees"),
    ({"resample": 2}, None, "resamples"),
    ({"do_normalize": False}, None, "do_normalize"),
    ({"size": {"height": 224, "width": 224}}, None, "no shortest_edge and longest_edge"),
    (None, {"spatial_merge_size": 4}, "merge_size=2 disagrees"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, pre, vision, match):
    h.assert_refuses(glm4v, h.variant(ckpt, tmp_path, pre=pre, vision=vision), match)


def test_configure_takes_hfs_video_defaults_and_refuses_the_bounds_glms_sampler_lacks(ckpt, tmp_path):
    """Without a video processor file HF's Glm4vVideoProcessor takes the image processor's preprocessor_config.json
    (its ``size`` the whole clip's bounds) over its class defaults (2 fps, max_duration 300 s); --video-fps and
    --video-max-pixels are the user's; GLM's sampler has no frame-count or token bounds and reads no num_frames, so
    the settings for them are refused, as are a video processor of another class and a patch size the tower does not
    have."""
    for name in ("bare", "other", "patch", "size"):
        (tmp_path / name).mkdir()
    bare = h.variant(ckpt, tmp_path / "bare")
    (bare / "video_preprocessor_config.json").unlink()
    im = _configure(bare).image
    assert (im.video, im.video_fps, im.video_max_duration, im.video_sample_frames) == ("glm4v", 2.0, 300.0, True)
    assert (im.video_min_pixels, im.video_max_pixels) == (2 * 4 * FACTOR ** 2, 2 * 64 * FACTOR ** 2)
    mine = _configure(ckpt, **{"image.video_fps": 1.0, "image.video_max_pixels": 48 * FACTOR ** 2}).image
    assert (mine.video_fps, mine.video_max_pixels) == (1.0, 48 * FACTOR ** 2)
    for key in ("image.video_max_frames", "image.video_min_frames", "image.video_max_tokens", "image.video_num_frames"):
        with pytest.raises(ValueError, match="has no such setting"):
            _configure(ckpt, **{key: 8})
    for name, change, match in (("other", {"video_processor_type": "Qwen2VLVideoProcessor"}, "Glm4vVideoProcessor"),
                                ("patch", {"patch_size": 16}, "patch_size=16 disagrees"),
                                ("size", {"size": {"longest_edge": 1000}}, "no shortest_edge and longest_edge")):
        d = h.variant(ckpt, tmp_path / name)
        video = json.loads((d / "video_preprocessor_config.json").read_text())
        (d / "video_preprocessor_config.json").write_text(json.dumps({**video, **change}))
        with pytest.raises(ValueError, match=match):
            _configure(d)


def test_glm_4_1v_thinkings_template_is_refused_naming_why(ckpt, tmp_path):
    """GLM-4.1V-9B-Thinking's published template writes a system / assistant message's content as is, a list of parts
    as Python text (HF's own render does so too): the data path refuses it, saying so, rather than train on it."""
    from transformers import AutoTokenizer

    from ray_mmbatch.data.text.encoder import tokenizer_for
    from ray_mmbatch.data.text.template import ChatTemplateError
    from tests.hf_glm4v_checkpoint import GLM4_1V_THINKING

    d = h.variant(ckpt, tmp_path)
    (d / "chat_template.jinja").write_text(GLM4_1V_THINKING)
    rendered = AutoTokenizer.from_pretrained(str(d)).apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], tokenize=False)
    assert rendered == "[gMASK]<sop><|user|>\nHi<|assistant|>\nHello."  # string content renders as published
    cfg41 = _configure(d)
    with pytest.raises(ChatTemplateError, match="content parts as Python text"):
        h.through_the_data_path(h.spec_rows(SPECS[:2]), cfg41, tokenizer_for(cfg41.text))


# ------------------------------------------------------------------ export, registry, FSDP, LoRA / freeze, verify
def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads with from_pretrained, computes the same logits (fed the packed kwargs of
    one image sample) and configures the same way."""
    again = h.check_export(glm4v, model, cfg, collate("pack", [built[0][1]], 0), tmp_path)
    assert again.image == cfg.image and again.text.image_token == cfg.text.image_token


test_registry_finds_the_backend = h.registry_test(glm4v)
test_configure_refuses_other_model_types_and_no_path = h.other_model_types_test(glm4v, "a GLM-4.1V model",
                                                                                "qwen2_vl")


test_fsdp_units_are_the_decoder_layers_and_vision_is_apart = h.fsdp_layout_test(glm4v, 2, ["hf_model.model.visual"])


def test_freeze_parts_and_lora_keep_packing_exact(cfg, tok, built, tol, tmp_path):
    """--freeze: vision = the tower less its merger, projector = the merger (LLaMA-Factory's split for GLM-4.1V);
    LoRA on the language model's linear layers keeps a packed batch exact and reloads with PEFT."""
    h.check_freeze_and_lora(glm4v, cfg, tok, built[0], built[1], tmp_path,
                            {"vision": lambda n: ".visual." in n and ".merger." not in n,
                             "projector": ".visual.merger."},
                            ".self_attn.q_proj.", tol.ce, lora_std=0.1)


test_verify_packing_job_through_the_data_path = h.verify_packing_test(glm4v, 1024)


test_the_public_api_loads_it = h.public_api_test(lambda c: c.image.resize == "smart_glm")
