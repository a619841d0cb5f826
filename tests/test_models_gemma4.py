"""Gemma 4 backend (issue 45): configure() from a checkpoint, ids / pixels / costs as HF's processor gives them, and
packed / padded batches exactly equal to HF run per sample, with HF's own packing shown not to be.

The reference is HF's own path, one sample at a time: the checkpoint's Gemma4Processor (its tokenizer, chat
template and PIL image processor; its video half left out: HF's Gemma 4 video processor needs torchvision) on
the chat template's render and the PIL images -> ``Gemma4ForConditionalGeneration(input_ids, pixel_values,
image_position_ids, mm_token_type_ids, attention_mask)`` -> logits (softcapped) -> shifted CE. Our side is the
pipeline's: raw rows -> measure_batch -> materialize_sample -> collate_pack / collate_pad -> HFModel.target_ce.
The tiny checkpoint (tests/hf_gemma4_checkpoint.py: sliding / full / full / full, the last sharing the third's
keys and values, per-layer inputs, a logit softcap; a window of 12 tokens, shorter than an image
block of up to 70; initializer_range 0.2) makes each wrong mask move the loss far beyond the tolerance
(family_harness.TOLERANCE). What the family modules share: tests/family_harness.py.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config
from ray_mmbatch.models import gemma4, token_ids
from tests import family_harness as h
from tests.family_harness import collate
from tests.hf_gemma4_checkpoint import (
    MAX_SOFT_TOKENS,
    PATCH,
    POOL,
    SLIDING_WINDOW,
    gemma4_processor,
    make_gemma4_checkpoint,
)

LONG = ("Tell me, in as many words as you like, what you see when you look at the long strip of noise with "
        "one bright red stripe across it, and why a stripe like that would be drawn there at all.")
# text only (long), one wide image, a thin one (HF's edge case: a side floors to zero) with a square one, a small
# one (scaled up to the budget); answers ending in spaces (the template trims them)
SPECS = [
    (LONG, "I see noise. The stripe marks a row, so that a wrong resize or crop would show. ", []),
    ("<image>\nDescribe the picture in a few words please.", "A noisy strip with a bright stripe.", [(170, 45)]),
    ("<image>\n<image>\nCompare these two images.", "The first is a thin line, the second a square.  ",
     [(2, 150), (64, 64)]),
    ("<image>\nColour?", "Red on grey.", [(20, 30)]),
]
BLOCK = ("<|image|>", "<|image><|image|><image|>")

ckpt, cfg, tok, model, reference, tol = h.family_fixtures(gemma4, make_gemma4_checkpoint)


@pytest.fixture(scope="module")
def processor(ckpt):
    return gemma4_processor(ckpt)


def _hf_inputs(processor, user: str, answer: str, pics: list) -> dict:
    text = h.chat_text(processor.tokenizer, user, answer, len(pics))
    out = processor(text=text, images=[[p for p in pics]] if pics else None, add_special_tokens=False,
                    return_tensors="pt")
    kwargs = {"input_ids": out["input_ids"][0].tolist(), "mm_token_type_ids": out["mm_token_type_ids"]}
    if pics:
        kwargs.update(pixel_values=out["pixel_values"], image_position_ids=out["image_position_ids"])
    return kwargs


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    """Samples through the pipeline's data path, with each one's HF processor inputs, and the measured rows."""
    samples, measured, decoded = h.through_the_data_path(h.spec_rows(SPECS), cfg, tok)
    return samples, [_hf_inputs(processor, u, a, d) for (u, a, _), d in zip(SPECS, decoded)], measured


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(model, built, tok, cfg):
    """ids (template, image blocks, trimmed answers), mm_token_type_ids, pixel_values and image_position_ids equal
    the processor's; the cost measured from the headers (tokens, image tokens) is its token count exactly."""
    samples, hf, measured = built
    image_id = model.hf_model.config.image_token_id
    for s, inputs in zip(samples, hf):
        assert s["input_ids"].tolist() == inputs["input_ids"]
        ours = model.forward_inputs(collate("pad", [s], tok.pad_token_id))
        assert torch.equal(ours["mm_token_type_ids"], inputs["mm_token_type_ids"].long())
        if "pixel_values" not in inputs:
            assert "pixel_values" not in ours and len(s["patches"]) == 0
            continue
        assert torch.equal(ours["image_position_ids"], inputs["image_position_ids"])
        assert ours["pixel_values"].shape == inputs["pixel_values"].shape  # [n, 630, 48]: padded to the budget
        assert torch.equal(ours["pixel_values"], inputs["pixel_values"])  # bit for bit
    assert list(measured[S.TOKENS]) == [len(i["input_ids"]) for i in hf]
    assert list(measured[S.IMAGE_TOKENS]) == [int((np.asarray(i["input_ids"]) == image_id).sum()) for i in hf]
    # every image near the budget (small ones scaled up), the thin one through HF's edge case
    assert [int(t) for t in measured[S.IMAGE_TOKENS]] == [0, 64, 70 + 64, 60]
    assert cfg.image.max_pixels == MAX_SOFT_TOKENS * POOL ** 2 * PATCH ** 2


@pytest.mark.parametrize("sizes", [[(h_, w) for h_ in (1, 2, 3, 7, 45, 100, 101, 640, 4000) for w in
                                    (1, 2, 5, 64, 150, 999, 3000)]])
def test_budget_resize_is_hfs_formula(cfg, sizes):
    """data/image/budget.py against HF's own get_aspect_ratio_preserving_size, over thin, tiny and large sizes at
    two budgets: the same target size, or HF raises and the image is skipped."""
    from transformers.models.gemma4.image_processing_pil_gemma4 import get_aspect_ratio_preserving_size

    from ray_mmbatch.data.image import ImageSkip, budget_resize

    for soft in (70, 280):
        icfg = copy.deepcopy(cfg.image)
        icfg.max_pixels = soft * POOL ** 2 * PATCH ** 2
        for hh, ww in sizes:
            try:
                want = get_aspect_ratio_preserving_size(hh, ww, PATCH, soft * POOL ** 2, POOL)
            except ValueError:
                with pytest.raises(ImageSkip):
                    budget_resize(hh, ww, icfg)
                continue
            assert budget_resize(hh, ww, icfg) == want, (hh, ww, soft)


# ------------------------------------------------------------------ exactness and its controls
test_batch_equals_each_sample_alone = h.exactness_test()


def test_pack_is_exact_with_eager_attention(cfg, built, tok, tol):
    """The masks come from transformers' mask builder, so eager gets them in its own (additive) format. Judged
    against HF's own path on eager too: HF's eager and sdpa paths are 4.8e-5 apart on this checkpoint (the random
    towers amplify their different rounding), which says nothing about packing."""
    eager_cfg = copy.deepcopy(cfg)
    eager_cfg.model.attn_implementation = "eager"
    eager = gemma4.create_model(eager_cfg, token_ids(cfg)).eval()
    assert eager.hf_model.config.get_text_config()._attn_implementation == "eager"
    samples, hf, _ = built
    with torch.no_grad():
        want = torch.cat([h.reference_ce(eager.hf_model, s["labels"], **kw) for s, kw in zip(samples, hf)])
        ce = eager.target_ce(collate("pack", samples, tok.pad_token_id))
    assert (ce - want).abs().max().item() < tol.ce


def _with_image_blocks(mask, mm_token_type_ids):
    """A [1, 1, T, T] bool mask with every image block made all-to-all (Gemma 3's rule on Gemma 4's full layers)."""
    image = mm_token_type_ids[0].bool()
    blocks = torch.cumsum(image & ~torch.roll(image, 1), 0)
    return mask | (image[:, None] & image[None, :] & (blocks[:, None] == blocks[None, :]))[None, None]


@pytest.mark.parametrize("naive", ["hf_position_id_packing", "no_sample_boundaries", "causal_image_blocks",
                                   "bidirectional_full_layers", "no_sliding_window", "pad_without_token_types"])
def test_naive_feeds_are_caught(model, built, reference, tok, tol, naive):
    """Each naive feed moves some target token's CE by more than 100 x the tolerance; HF's own packing from the
    restarting position ids (the naive packed feed) by more than 0.1 nats."""
    batch = collate("pad" if naive == "pad_without_token_types" else "pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    if naive == "hf_position_id_packing":  # HF finds the samples from the restarting position ids itself
        del kwargs["attention_mask"]
    elif naive == "no_sample_boundaries":  # one causal row with image blocks: HF's single-sample path
        del kwargs["attention_mask"]
        kwargs["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    elif naive == "causal_image_blocks":  # no image block anywhere
        kwargs["attention_mask"] = model._adapter.packed_masks(batch, torch.zeros_like(batch["input_ids"]))
    elif naive == "bidirectional_full_layers":
        masks = kwargs["attention_mask"]
        masks["full_attention"] = _with_image_blocks(masks["full_attention"], kwargs["mm_token_type_ids"])
    elif naive == "no_sliding_window":
        kwargs["attention_mask"]["sliding_attention"] = model._adapter.packed_masks(
            batch, kwargs["mm_token_type_ids"])["full_attention"]
    else:
        del kwargs["mm_token_type_ids"]
    moved = h.check_caught(model, batch, kwargs, reference[0], naive, tol)
    if naive == "hf_position_id_packing":
        assert moved > 0.1


def test_packed_masks_keep_samples_apart_and_image_blocks_whole_on_sliding_layers_only(model, built, tok):
    """The sdpa masks themselves: no entry across samples; full layers causal; on sliding layers each image block
    all-to-all within the window's past bound, nothing else in the future."""
    batch = collate("pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    full, sliding = (kwargs["attention_mask"][k][0, 0] for k in ("full_attention", "sliding_attention"))
    sample = torch.repeat_interleave(torch.arange(len(built[0])), batch["seq_lens"].long())
    same = sample[:, None] == sample[None, :]
    t = torch.arange(full.shape[0])
    assert torch.equal(full, same & (t[None, :] <= t[:, None]))
    image = kwargs["mm_token_type_ids"][0].bool()
    blocks = torch.cumsum(image & ~torch.roll(image, 1), 0)
    same_block = image[:, None] & image[None, :] & (blocks[:, None] == blocks[None, :])
    assert torch.equal(sliding, same & ((t[None, :] <= t[:, None]) | same_block) & (t[None, :] > t[:, None] -
                                                                                   SLIDING_WINDOW))
    assert same_block.sum() > (image.sum()) * 10  # blocks of many tokens


test_text_only_batch_and_every_trainable_weight_gets_a_gradient = h.text_only_test(0)


def test_verify_packing_command_passes(ckpt, tmp_path_factory, capsys, tol):
    """The verify-packing command on synthetic data through the real data path (local_batches), pack mode."""
    report = h.verify_packing(ckpt, h.generated_data(tmp_path_factory, "gemma4_verify_data", 12, seed=3), "pack",
                              1024, capsys, tol)
    assert report["samples"] > report["batches"]


# ------------------------------------------------------------------ configure
def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.patch_size, im.merge_size, im.temporal_patch_size, im.max_pixels) == \
        ("budget", PATCH, POOL, 1, MAX_SOFT_TOKENS * POOL ** 2 * PATCH ** 2)
    assert im.image_mean == (0.0,) * 3 and im.image_std == (1.0,) * 3
    assert (cfg.text.tokenizer, cfg.text.image_token, cfg.text.image_block) == (str(ckpt), "<|image|>", BLOCK)
    assert (cfg.text.video_token, cfg.text.family) == ("<|video|>", "Gemma 4")  # video: tests/test_video.py
    assert (im.video, im.video_num_frames, im.video_max_pixels) == \
        ("gemma4", 4, MAX_SOFT_TOKENS * POOL ** 2 * PATCH ** 2)
    assert gemma4.configure(copy.deepcopy(cfg)).text == cfg.text  # idempotent


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(gemma4, [
    ("image.merge_size", 4), ("image.patch_size", 16), ("image.resize", "squash"), ("image.max_pixels", 1000),
    ("text.image_token", "<|image>"), ("image.image_mean", "0.5,0.5,0.5")])


@pytest.mark.parametrize("config,pre,text,match", [
    (None, {"max_soft_tokens": 100}, None, "max_soft_tokens=100"),
    (None, {"patch_size": 8}, None, "vision tower has 4 / 3"),
    (None, {"resample": 2}, None, "only bicubic"),
    (None, {"do_rescale": False}, None, "rescaled by 1/255"),
    (None, None, {"use_bidirectional_attention": "all"}, "an encoder"),
    (None, None, {"enable_moe_block": True, "num_experts": 2, "top_k_experts": 1, "moe_intermediate_size": 8},
     "MoE"),
    ({"model_type": "gemma3"}, None, None, "not Gemma 4"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, text, match):
    d = h.variant(ckpt, tmp_path, config=config)
    files = json.loads((d / "processor_config.json").read_text())
    files["image_processor"].update(pre or {})
    (d / "processor_config.json").write_text(json.dumps(files))
    if text:
        data = json.loads((d / "config.json").read_text())
        data["text_config"].update(text)
        (d / "config.json").write_text(json.dumps(data))
    h.assert_refuses(gemma4, d, match)


def test_create_model_refuses_flash_attention_and_unconfigured_data(cfg):
    flash = copy.deepcopy(cfg)
    flash.model.attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="does not run on flash_attention_2"):
        gemma4.create_model(flash, token_ids(cfg))
    smart = copy.deepcopy(cfg)
    smart.image.resize = "smart"
    with pytest.raises(ValueError, match="call configure"):
        gemma4.create_model(smart, token_ids(cfg))
    with pytest.raises(ValueError, match="model.path"):
        gemma4.configure(Config())


def test_a_sample_with_audio_is_refused_naming_the_family_and_the_modality(cfg, tok):
    """An audio part of HF messages becomes an <audio> slot (formats/records.py), and measure skips a sample with one
    as unsupported_modality naming Gemma 4 and audio; the same sample without it trains."""
    from ray_mmbatch.data.measure import measure_batch
    from ray_mmbatch.formats.records import conversations_to_json

    turns = [{"role": "user", "content": [{"type": "audio", "path": "a.wav"}, {"type": "text", "text": "What?"}]},
             {"role": "assistant", "content": "A bell."}]
    with_audio, error = conversations_to_json(turns)
    assert not error and "<audio>What?" in with_audio
    without, _ = conversations_to_json([{"role": "user", "content": "What?"}, turns[1]])
    raw = h.raw_rows(["a", "b"], [json.loads(with_audio), json.loads(without)], [[], []])
    reasons = list(measure_batch(raw, cfg.image, tok, cfg.text)[S.SKIP_REASON])
    assert reasons[0] == f"{S.SKIP_UNSUPPORTED_MODALITY}: audio in turn 0: Gemma 4 is trained on text and images " \
        "here, not audio"
    assert reasons[1] == ""


# ------------------------------------------------------------------ export, registry, FSDP, LoRA / freeze, API
def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads with from_pretrained, computes the same logits and configures the
    same way."""
    again = h.check_export(gemma4, model, cfg, collate("pad", [built[0][1]], 0), tmp_path)
    assert again.image == cfg.image and again.text.image_block == BLOCK


test_registry_finds_the_backend = h.registry_test(gemma4)


test_fsdp_units_are_the_decoder_layers_and_vision_is_apart = h.fsdp_layout_test(
    gemma4, 4, ["hf_model.model.vision_tower", "hf_model.model.embed_vision"])


def test_freeze_parts_and_lora_keep_packing_exact(cfg, tok, built, tmp_path, tol):
    """--freeze: vision = the tower, projector = embed_vision; LoRA (default: the language model's linear layers)
    trains adapters only, a packed batch stays exact against each sample alone through the adapted HF model, and
    the exported adapter reloads with PEFT."""
    h.check_freeze_and_lora(gemma4, cfg, tok, built[0], built[1], tmp_path,
                            {"vision": lambda n: ".vision_tower." in n, "projector": lambda n: ".embed_vision." in n},
                            ".self_attn.q_proj.", tol.ce)


test_the_public_api_loads_it = h.public_api_test(lambda c: c.text.image_block == BLOCK)
