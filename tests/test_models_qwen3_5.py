"""Qwen3.5 backend (issue 45): configure() from a checkpoint, ids / pixels / costs as HF's processor gives them,
packed and padded batches exact through the Gated DeltaNet layers, and HF's own packed forward shown to leak.

The reference is HF's own path, one sample at a time: the checkpoint's chat template rendered and expanded by
HF's Qwen3VLProcessor (the processor class the Qwen3.5 repos name; its video half left out, no torchvision here:
video is tests/test_video.py's, against HF's processor in the reference interpreter),
``pixel_values`` from the checkpoint's PIL image processor, fed to ``Qwen3_5(Moe)ForConditionalGeneration
(input_ids, pixel_values, image_grid_thw, mm_token_type_ids, attention_mask=ones)`` -> logits -> shifted CE.
Our side is the pipeline's: raw rows -> measure_batch -> materialize_sample -> collate_pack / collate_pad ->
HFModel.target_ce. The tiny random checkpoints (tests/hf_checkpoints.make_qwen3_5_checkpoint: DeltaNet, full
attention, DeltaNet; initializer_range 0.2) make a leaked recurrent state or conv window move the loss by far
more than the tolerance (family_harness.TOLERANCE, measured there). Each test runs on the dense and the MoE
checkpoint. What the family modules share: tests/family_harness.py.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from ray_mmbatch import schema as S
from ray_mmbatch.models import deltanet, qwen3_5
from ray_mmbatch.models.hf_common import normalize_patches
from ray_mmbatch.run.verify import DEFAULT_TOLERANCE
from tests import family_harness as h
from tests.family_harness import collate
from tests.hf_checkpoints import QWEN3_5_LAYERS, QWEN3_5_MODEL_TYPES, make_qwen3_5_checkpoint

LONG = ("Tell me, in as many words as you like, what you see when you look at the long strip of noise with "
        "one bright red stripe across it, and why a stripe like that would be drawn there at all.")
# text only (long: the control's leak grows with it), one wide image, two images, one small image
SPECS = [
    (LONG, "I see noise. The stripe marks a row, so that a wrong resize or crop would show. " * 3, []),
    ("<image>\nDescribe the picture in a few words please.", "A noisy strip with a bright stripe.", [(170, 45)]),
    ("<image>\n<image>\nCompare these two images.", "The first is wide, the second is a square.",
     [(90, 40), (64, 64)]),
    ("<image>\nColour?", "Red on grey.", [(20, 30)]),
]

ckpt, cfg, tok, model, reference, _tol = h.family_fixtures(
    qwen3_5, make_qwen3_5_checkpoint, params=QWEN3_5_MODEL_TYPES, ids=list(QWEN3_5_MODEL_TYPES))
del _tol  # one TOLERANCE per model type (dense, MoE), not per backend: the fixture below


@pytest.fixture(scope="module")
def tol(model):
    return h.TOLERANCE[model.hf_model.config.model_type]


@pytest.fixture(scope="module")
def processor(ckpt):
    from tests import targets_reference as R

    return R.hf_processor(ckpt, "qwen3_vl")  # Qwen3.5's repos name Qwen3VLProcessor


def _hf_inputs(processor, image_token_id: int, user: str, answer: str, pics: list) -> dict:
    """HF's processor on the sample's chat render: ids, pixel_values, image_grid_thw, mm_token_type_ids."""
    text = h.chat_text(processor.tokenizer, user, answer, len(pics))
    out = processor(text=[text], images=[[p.convert("RGB") for p in pics]] if pics else None, return_tensors="pt")
    ids = out["input_ids"][0]
    kwargs = {"input_ids": ids.tolist()}
    if pics:
        kwargs.update(pixel_values=out["pixel_values"].float(), image_grid_thw=out["image_grid_thw"],
                      mm_token_type_ids=(ids == image_token_id).int()[None])
    return kwargs


@pytest.fixture(scope="module")
def built(cfg, tok, processor, model):
    """Samples through the pipeline's data path, with each one's HF processor inputs."""
    samples, measured, decoded = h.through_the_data_path(h.spec_rows(SPECS), cfg, tok)
    image_id = model.hf_model.config.image_token_id
    return samples, [_hf_inputs(processor, image_id, u, a, d) for (u, a, _), d in zip(SPECS, decoded)], measured


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(built, cfg, tok):
    """ids (chat template, image blocks), grids and pixels equal HF's processor; the cost measured from the image
    headers before any decode (tokens, image tokens) is the processor's token count exactly."""
    samples, hf, measured = built
    image_id = tok.convert_tokens_to_ids(cfg.text.image_token)
    for s, inputs in zip(samples, hf):
        assert s["input_ids"].tolist() == inputs["input_ids"]
        if "pixel_values" not in inputs:
            assert len(s["patches"]) == 0
            continue
        assert s["grids"].tolist() == inputs["image_grid_thw"].tolist()
        ours = normalize_patches(torch.as_tensor(s["patches"]), cfg.image.image_mean, cfg.image.image_std,
                                 cfg.image.temporal_patch_size)
        assert ours.shape == inputs["pixel_values"].shape
        assert (ours - inputs["pixel_values"]).abs().max().item() < 1e-5
    assert list(measured[S.TOKENS]) == [len(i["input_ids"]) for i in hf]
    assert list(measured[S.IMAGE_TOKENS]) == [int((np.asarray(i["input_ids"]) == image_id).sum()) for i in hf]
    assert list(measured[S.N_IMAGES]) == [len(sizes) for *_, sizes in SPECS]


def test_beyond_max_aspect_is_skipped_with_a_reason(cfg):
    h.assert_extreme_aspect_skipped(cfg.image)  # HF's Qwen2-VL processor refuses aspect ratios over 200


# ------------------------------------------------------------------ exactness
test_batch_equals_each_sample_alone = h.exactness_test()


def _without_segments(kwargs: dict) -> dict:
    kwargs.pop(deltanet.SEGMENTS)
    return kwargs


def test_hf_own_packed_forward_leaks_the_deltanet_state_and_ours_does_not(model, built, reference, tok, tol):
    """HF's packed forward as HF documents packing (restarting positions, its own M-RoPE ids) differs from each
    sample alone by more than 0.1 nats on CPU -- its torch DeltaNet fallbacks carry state and conv window from
    one sample into the next -- while the same kwargs with the segments are exact. The leak is the DeltaNet
    layers' only: the full-attention layers already get per-sample masks from the positions."""
    batch = collate("pack", built[0], tok.pad_token_id)
    leaked = h.check_caught(model, batch, _without_segments(model.forward_inputs(batch)), reference[0],
                            "HF's packed forward (no DeltaNet segments)", tol)
    assert leaked > 0.1
    first = int((batch["labels"][0, :batch["cu_seqlens"][1]] != S.IGNORE_INDEX).sum())
    with torch.no_grad():
        hidden = model.hf_model.model(**_without_segments(model.forward_inputs(batch))).last_hidden_state
        ce = model._target_ce(hidden, batch["labels"], "none")
        exact = model.target_ce(batch)
    assert (ce[:first] - reference[0][:first]).abs().max().item() < tol.ce  # the first sample has nothing before it
    assert (exact - reference[0]).abs().max().item() < tol.ce


@pytest.mark.parametrize("naive", ["positions_not_restarting", "use_cache"])
def test_naive_packing_is_caught(model, built, reference, tok, tol, naive):
    """The tolerance is meaningful: 1-D positions counting on across the row (no per-sample mask, no M-RoPE), and
    a cache (HF stops looking for packed samples; the DeltaNet layers run HF's own forward) move the CE by more
    than 100 x it."""
    batch = collate("pack", built[0], tok.pad_token_id)
    h.check_caught(model, batch, h.naive_inputs(model, batch, naive), reference[0], naive, tol)


def _deltanet_layers(model) -> list:
    return [m for m in model.hf_model.modules() if deltanet.is_deltanet(m)]


@pytest.mark.parametrize("lengths", [(5, 70, 130, 3, 64, 65, 1), (200,), (1, 1, 2)])
def test_each_deltanet_layer_starts_every_sample_from_zero(model, lengths):
    """Layer by layer, on random hidden states: the segmented forward of a packed row equals HF's forward of each
    sample alone (zero state, empty conv window), with samples grouped by chunk count (several of one count,
    counts 1-3, lengths 1 and exactly 64); HF's forward over the whole row does not (but for the first sample)."""
    layers = _deltanet_layers(model)
    assert len(layers) == QWEN3_5_LAYERS.count("linear_attention")
    bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    torch.manual_seed(1)
    x = torch.randn(1, bounds[-1], model.hf_model.config.text_config.hidden_size)
    with torch.no_grad():
        for layer in layers:
            ours = layer(x, **{deltanet.SEGMENTS: tuple(bounds)})
            alone = torch.cat([type(layer).forward(layer, x[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])], 1)
            assert (ours - alone).abs().max().item() < 1e-5
            whole = type(layer).forward(layer, x)
            assert (whole[:, :lengths[0]] - alone[:, :lengths[0]]).abs().max().item() < 1e-5
            if len(lengths) > 1:
                assert (whole - alone).abs().max().item() > 1e-2  # HF's forward over the row carries state over
            assert torch.equal(layer(x), whole)  # no segments: HF's forward unchanged


def test_deltanet_segments_refuse_a_row_they_do_not_cover(model):
    layer = _deltanet_layers(model)[0]
    x = torch.zeros(1, 10, model.hf_model.config.text_config.hidden_size)
    with pytest.raises(ValueError, match="do not cover the packed row"):
        layer(x, **{deltanet.SEGMENTS: (0, 4, 9)})


def test_kernels_are_used_only_on_cuda_with_both_installed():
    """The fla / causal-conv1d path is taken only where both import and the row is on CUDA (not here: CPU)."""
    assert not deltanet.kernels_available(torch.device("cpu"))


test_text_only_batch_and_every_weight_gets_a_gradient = h.text_only_test()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_train_mode_and_gradient_checkpointing_keep_the_segments(cfg, tok, built, reference, tol, checkpointing):
    """In train mode (transformers' ``train()`` re-kernelizes the model and resets the DeltaNet layers' forward:
    the adapter puts it back) and with activation checkpointing (the decoder layers run again in the backward
    pass, the segments with them: they travel as a keyword) the packed batch's CE and gradients are still each
    sample's alone; without the adapter's check, HF's forward would be back after ``train()``."""
    import copy

    train_cfg = copy.deepcopy(cfg)
    train_cfg.model.gradient_checkpointing = checkpointing
    model = qwen3_5.create_model(train_cfg, h.token_ids(cfg, tok)).train()
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing
    layers = _deltanet_layers(model)
    assert all("forward" not in m.__dict__ for m in layers)  # what train() did to the installed forward
    h.check_exact(model, collate("pack", built[0], tok.pad_token_id), reference, f"pack, train, {checkpointing=}",
                  tol)
    assert all(m.forward.__func__ is deltanet.segmented_forward for m in layers)


# ------------------------------------------------------------------ explicit varlen metadata (flash attention)
def _text_config(hf_model):
    return hf_model.model.language_model.config


test_varlen_kwargs_only_for_flash_implementations = h.varlen_kwargs_test(_text_config)


def test_flash_attention_gets_the_varlen_metadata_and_the_deltanet_layers_the_segments(model, built, reference, tok,
                                                                                        tol):
    """On a flash-named implementation (tests/varlen_check: each sample alone through sdpa when told the
    boundaries) the full-attention layers get the row's cu_seq_lens and the loss is exact; HF's DeltaNet layers,
    given those same kwargs on CPU, refuse to run (its torch fallback cannot keep packed samples apart)."""
    from tests import varlen_check

    pack = collate("pack", built[0], tok.pad_token_id)
    config = _text_config(model.hf_model)
    with varlen_check.flash_named(config) as recorded, torch.no_grad():
        ce = model.target_ce(pack)
        assert len(recorded) == QWEN3_5_LAYERS.count("full_attention")
        assert all(r["cu_seq_lens_q"].tolist() == pack["cu_seqlens"].tolist() for r in recorded)
        assert (ce - reference[0]).abs().max().item() < tol.ce
        kwargs = _without_segments(model.forward_inputs(pack))
        layer = _deltanet_layers(model)[0]
        with pytest.raises(ValueError, match="can't keep packed sequences apart"):
            type(layer).forward(layer, torch.zeros(1, 4, config.hidden_size), **{
                k: kwargs[k] for k in varlen_check.KEYS})


# ------------------------------------------------------------------ configure
_configure = partial(h.configure, qwen3_5)


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.patch_size, im.merge_size, im.temporal_patch_size) == ("smart", 16, 2, 2)
    assert (im.min_pixels, im.max_pixels) == (4 * 32 * 32, 64 * 32 * 32)
    assert im.image_mean == pytest.approx((0.5,) * 3) and im.image_std == pytest.approx((0.5,) * 3)
    assert (cfg.text.tokenizer, cfg.text.image_token, cfg.text.chat_template) == (str(ckpt), "<|image_pad|>", "auto")
    # video as Qwen3-VL's (tests/test_video.py: the settings, frames, pixels, tokens and packing against HF's)
    assert (im.video, cfg.text.video_token) == ("qwen3_vl", "<|video_pad|>")
    again = qwen3_5.configure(cfg)
    assert again.image == cfg.image and again.text == cfg.text
    fewer = _configure(ckpt, **{"image.max_pixels": 16 * 32 * 32})  # the resolution bound is the user's choice
    assert fewer.image.max_pixels == 16 * 32 * 32


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(qwen3_5, [
    ("image.patch_size", 28), ("image.merge_size", 4), ("image.image_mean", "0.4,0.4,0.4"), ("image.resize", "fixed"),
    ("text.image_token", "<image>")])


@pytest.mark.parametrize("pre,vision,match", [
    ({"patch_size": 14}, None, "patch_size=14 disagrees"),
    ({"resample": 2}, None, "resamples"),
    ({"do_normalize": False}, None, "do_normalize"),
    (None, {"spatial_merge_size": 4}, "merge_size=2 disagrees"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, pre, vision, match):
    h.assert_refuses(qwen3_5, h.variant(ckpt, tmp_path, pre=pre, vision=vision), match)


test_configure_refuses_other_model_types_and_no_path = h.other_model_types_test(qwen3_5, "a Qwen3.5 model",
                                                                                "qwen3_vl")


def test_create_model_refuses_a_foreign_image_token(cfg, tok):
    with pytest.raises(ValueError, match="image_token_id"):
        qwen3_5.create_model(cfg, h.token_ids(cfg, tok) | {"image_token_id": tok.convert_tokens_to_ids("<|im_end|>")})


# ------------------------------------------------------------------ export, registry, FSDP, LoRA / freeze, verify
def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads with from_pretrained, computes the same logits (fed the packed
    kwargs of one image sample) and configures the same way."""
    again = h.check_export(qwen3_5, model, cfg, collate("pack", [built[0][1]], 0), tmp_path)
    assert again.image == cfg.image and again.text.image_token == cfg.text.image_token


test_registry_finds_the_backend = h.registry_test(qwen3_5)


test_fsdp_units_are_the_decoder_layers_and_vision_is_apart = h.fsdp_layout_test(
    qwen3_5, len(QWEN3_5_LAYERS), ["hf_model.model.visual"])


def test_freeze_parts_and_lora_keep_packing_exact(cfg, tok, built, tmp_path):
    """--freeze names the parts as for Qwen-VL (visual less its merger; the merger); LoRA (default: the language
    model's linear layers, the DeltaNet projections among them) trains adapters only, a packed batch stays exact
    against each sample alone through the adapted HF model, and the exported adapter reloads with PEFT."""
    # the text-only sample and one image sample, our pixels: packing alone is judged (HF's vision tower rounds
    # differently over several samples' images at once, which the adapters amplify past the family's tolerance)
    samples = built[0][:2]
    hf = [kw | {"pixel_values": normalize_patches(torch.as_tensor(s["patches"]), cfg.image.image_mean,
                                                   cfg.image.image_std, cfg.image.temporal_patch_size)}
          if "pixel_values" in kw else kw for s, kw in zip(samples, built[1][:2])]
    # within verify-packing's fp32 default (run/verify.DEFAULT_TOLERANCE, what `verify-packing --lora-rank` checks):
    # the drawn adapters widen the logits, so the fp32 rounding of the packed row's longer attention rows moves a
    # token by up to 2.3e-5 here, above the family's tolerance for the bare checkpoint; a leak moves it by > 1e-2
    h.check_freeze_and_lora(qwen3_5, cfg, tok, samples, hf, tmp_path,
                            {"vision": lambda n: ".visual." in n and ".merger." not in n,
                             "projector": lambda n: ".visual.merger." in n}, ".linear_attn.in_proj_qkv.",
                            DEFAULT_TOLERANCE["fp32"], lora_std=0.1)


test_verify_packing_job_through_the_data_path = h.verify_packing_test(qwen3_5, 1024)


test_the_public_api_loads_it = h.public_api_test(lambda c: c.text.image_token == "<|image_pad|>")
