"""LLaVA backend: configure() from a checkpoint, and packed / padded batches exactly equal to HF run per sample.

The reference is HF's own path, one sample at a time: ``LlavaForConditionalGeneration(input_ids,
pixel_values=<the checkpoint's CLIP image processor on the PIL image>, attention_mask=ones)`` ->
logits -> shifted CE. Our side is the pipeline's: sample dicts -> collate_pack / collate_pad ->
batch_to_torch -> HFModel.target_ce. A tiny random checkpoint with initializer_range 0.2 makes
a wrong mask or wrong position ids move the loss by far more than the tolerance (checked below).
What the family modules share (fixtures, the exactness check, the controls): tests/family_harness.py.
"""
from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig
from ray_mmbatch.data.image import patchify
from ray_mmbatch.models import llava
from tests import family_harness as h
from tests.family_harness import collate
from tests.hf_llava_checkpoint import make_llava_checkpoint

SIDE, PS = 56, 14
N = (SIDE // PS) ** 2  # image tokens per image

# (question, answer, image sizes (w, h)): 0, 1, 2, 1 images, different text lengths
SPECS = [
    ("What is two plus two?", "Four.", []),
    ("Describe the picture in a few words please.", "A noisy square with a bright stripe across it.", [(70, 45)]),
    ("Compare these two images.", "The first is tall, the second is wide; both are noise.", [(40, 90), (100, 33)]),
    ("Colour?", "Mostly grey with some red, honestly hard to tell from so few pixels here.", [(56, 56)]),
]


ckpt, cfg, tok, model, reference, tol = h.family_fixtures(llava, lambda d: make_llava_checkpoint(d, image_size=SIDE))


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil.from_pretrained(str(ckpt))


def _image(w: int, h_: int, seed: int):
    return h.image(w, h_, seed, stripe=4)


def _hf_inputs(processor, sample: dict, pics: list) -> dict:
    """HF's inputs of ONE sample: its ids, the processor's pixels of its PIL images."""
    pixels = processor(pics, return_tensors="pt")["pixel_values"] if pics else None
    return {"input_ids": sample["input_ids"], "pixel_values": pixels}


def _hand_built(tok, processor, image_token_id: int) -> tuple[list[dict], list[list]]:
    """Sample dicts as materialize makes them, with the processor's own resized + cropped uint8 pixels."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    samples, images = [], []
    for i, (question, answer, sizes) in enumerate(SPECS):
        pics = [_image(w, hh, seed=10 * i + j) for j, (w, hh) in enumerate(sizes)]
        ids = enc("USER: ")
        for _ in pics:
            ids += [image_token_id] * N + enc("\n")
        prompt = ids + enc(question + " ASSISTANT:")
        answer_ids = enc(" " + answer)
        ids = np.array(prompt + answer_ids, np.int32)
        target = np.r_[np.zeros(len(prompt)), np.ones(len(answer_ids))].astype(bool)
        labels = np.full(len(ids), S.IGNORE_INDEX, np.int32)
        labels[:-1] = np.where(target[1:], ids[1:], S.IGNORE_INDEX)
        icfg = ImageConfig(patch_size=PS, merge_size=1)
        raw = [processor(p, do_rescale=False, do_normalize=False, return_tensors="np")["pixel_values"][0] for p in pics]
        patches = [patchify(np.ascontiguousarray(r.transpose(1, 2, 0)), icfg) for r in raw]
        samples.append({"sample_id": f"s{i}", "input_ids": ids, "labels": labels,
                        "patches": np.concatenate(patches) if patches else np.zeros((0, 3 * PS * PS), np.uint8),
                        "grids": np.array([[1, SIDE // PS, SIDE // PS]] * len(pics), np.int32).reshape(-1, 3)})
        images.append(pics)
    return samples, images


@pytest.fixture(scope="module")
def built(tok, processor, cfg):
    """(samples, HF's inputs of each, its PIL images)."""
    samples, images = _hand_built(tok, processor, tok.convert_tokens_to_ids(cfg.text.image_token))
    return samples, [_hf_inputs(processor, s, p) for s, p in zip(samples, images)], images


# ------------------------------------------------------------------ exactness
test_batch_equals_each_sample_alone = h.exactness_test()
# flash attention gets the packed row's cu_seq_lens / max_length explicitly (not inferred from ids)
test_flash_attention_gets_the_varlen_metadata = h.flash_varlen_test(lambda hf: hf.model.language_model.config)


def test_pack_is_exact_with_eager_attention(cfg, tok, built, reference, tol):
    """Packing detection lives in transformers' mask builder, so eager gets the same block-diagonal mask as sdpa."""
    h.check_pack_exact_with_eager(llava, cfg, tok, built[0], reference, lambda hf: hf.model.language_model.config,
                                  tol)


@pytest.mark.parametrize("naive", ["positions_not_restarting", "use_cache", "all_ones_mask"])
def test_naive_packing_is_caught(model, built, reference, tok, tol, naive):
    """The tolerance is meaningful: feeding the packed row the naive ways moves the CE by more than 100 x it
    (none of them is refused)."""
    batch = collate("pack", built[0], tok.pad_token_id)
    h.check_caught(model, batch, h.naive_inputs(model, batch, naive), reference[0], naive, tol)


def _frozen_are_the_unused_vision_weights(model):
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all("vision_tower.encoder.layers.1." in n or "post_layernorm" in n for n in frozen)


test_text_only_batch_and_every_trainable_weight_gets_a_gradient = h.text_only_test(
    then=_frozen_are_the_unused_vision_weights)


@pytest.fixture(scope="module")
def padded_variant(ckpt, tmp_path_factory):
    """The checkpoint with LLaVA's own image processor, do_pad on (pad to a square of the mean colour first)."""
    from transformers import LlavaImageProcessorPil

    d = h.variant(ckpt, tmp_path_factory.mktemp("llava_pad"))
    LlavaImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE},
                           do_pad=True).save_pretrained(d)
    return d


@pytest.mark.parametrize("kind", ["clip_crop", "llava_do_pad"])
def test_through_the_data_path(model, processor, cfg, tok, padded_variant, tol, kind):
    """measure_batch + materialize_sample (the pipeline's own pixels and tokens) vs HF on the decoded image."""
    from transformers import LlavaImageProcessorPil

    if kind == "llava_do_pad":  # same weights, so the model fixture serves; only the pixels differ
        cfg = _configure(padded_variant)
        assert cfg.image.resize == "fixed_pad"
        processor = LlavaImageProcessorPil.from_pretrained(str(padded_variant))
    pngs = [h.png(_image(70, 45, 1)), h.png(_image(40, 90, 2)), h.png(_image(100, 33, 3))]
    convs = [[{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise, mostly."}],
             [{"from": "human", "value": "Two: <image> and <image>"}, {"from": "gpt", "value": "Both are noise."}],
             [{"from": "human", "value": "No picture here."}, {"from": "gpt", "value": "Then nothing to see."}]]
    raw = h.raw_rows(["a", "b", "c"], convs, [[pngs[0]], pngs[1:], []], [["0.png"], ["1.png", "2.png"], []])
    samples, measured, decoded = h.through_the_data_path(raw, cfg, tok)
    grid = [1, SIDE // PS, SIDE // PS]
    assert [np.asarray(g).reshape(-1, 3).tolist() for g in measured[S.GRIDS]] == [[grid], [grid, grid], []]
    assert list(measured[S.TOKENS]) == [len(t) - n + n * N for t, n in zip(measured[S.TEXT_IDS], (1, 2, 0))]
    image_id = tok.convert_tokens_to_ids(cfg.text.image_token)
    assert int(measured[S.IMAGE_TOKEN_ID][0]) == image_id
    assert [int((s["input_ids"] == image_id).sum()) for s in samples] == [N, 2 * N, 0]
    with torch.no_grad():
        ref = torch.cat([h.reference_ce(model.hf_model, s["labels"], **_hf_inputs(processor, s, d))
                         for s, d in zip(samples, decoded)])
        for mode in ("pack", "pad"):
            diff = (model.target_ce(collate(mode, samples, tok.pad_token_id)) - ref).abs().max().item()
            print(f"data path {kind}, {mode}: max per-token CE diff {diff:.2e}")
            assert diff < tol.ce


# ------------------------------------------------------------------ configure
_configure = partial(h.configure, llava)


def test_configure_takes_the_checkpoint_settings(cfg, ckpt, tmp_path):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.temporal_patch_size) == ("fixed", SIDE, PS, 1, 1)
    assert im.image_mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert (cfg.text.tokenizer, cfg.text.image_token) == (str(ckpt), "<image>")
    own = _configure(h.variant(ckpt, tmp_path, pre={"image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]}))
    assert (own.image.image_mean, own.image.image_std) == ((0.5,) * 3, (0.25,) * 3)
    # settings equal to the checkpoint's are fine; so is a tokenizer of the user's own
    same = _configure(ckpt, **{"image.image_size": SIDE, "image.merge_size": 1, "text.image_token": "<image>",
                               "text.tokenizer": str(ckpt)})
    assert same.image.resize == "fixed"


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(llava, [
    ("image.merge_size", 4), ("image.image_size", 224), ("image.patch_size", 16), ("image.image_mean", "0.5,0.5,0.5"),
    ("text.image_token", "<img>"), ("image.temporal_patch_size", 2)])


@pytest.mark.parametrize("config,pre,match", [
    ({"vision_feature_select_strategy": "full"}, None, "vision_feature_select_strategy='full'"),
    (None, {"do_pad": True}, "do_pad=true outside LlavaImageProcessor"),
    (None, {"crop_size": {"height": 42, "width": 42}}, "shortest_edge 56 != crop 42"),
    (None, {"size": {"shortest_edge": 42}, "crop_size": {"height": 42, "width": 42}}, "vision tower takes 56"),
    (None, {"size": {"height": 56, "width": 56}}, "not a fixed-resize setting"),
    (None, {"resample": 2}, "bicubic"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, match):
    h.assert_refuses(llava, h.variant(ckpt, tmp_path, config=config, pre=pre), match)


test_configure_refuses_other_model_types_and_no_path = h.other_model_types_test(llava, "LLaVA", other="qwen2_vl")


def test_create_model_refuses_a_foreign_image_token(cfg, tok):
    with pytest.raises(ValueError, match="image_token_id"):
        llava.create_model(cfg, h.token_ids(cfg, tok) | {"image_token_id": tok.convert_tokens_to_ids(S.IMAGE_PAD)})


def test_create_model_refuses_a_tokenizer_bigger_than_the_embeddings(cfg, tok):
    with pytest.raises(ValueError, match="model embeds"):
        llava.create_model(cfg, h.token_ids(cfg, tok) | {"vocab_size": len(tok) + 7})


def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    again = h.check_export(llava, model, cfg, collate("pack", [built[0][1]], 0), tmp_path)
    assert (again.image.resize, again.image.image_size, again.text.image_token) == ("fixed", SIDE, "<image>")


test_registry_finds_the_backend = h.registry_test(llava)
