"""Mistral 3 backend (issue 45, item 4): configure() from a checkpoint, ids / pixels / costs as HF's Pixtral processor
gives them, and packed / padded batches exactly equal to HF run per sample; the Pixtral tower keeps the images of a
batch apart.

The reference is HF's own path, one sample at a time: the checkpoint's PixtralProcessor (its tokenizer, chat template,
PIL image processor and processor_config.json; built without torchvision, tests/hf_mistral3_checkpoint.py) on the chat
template's render and the PIL images -> ``Mistral3ForConditionalGeneration(input_ids, pixel_values, image_sizes,
attention_mask)`` -> logits -> shifted CE. Our side is the pipeline's: raw rows -> measure_batch -> materialize_sample
-> collate_pack / collate_pad -> HFModel.target_ce. Every test runs on two tiny checkpoints: a Mistral text model
(Mistral-Small-3.1 / 3.2, Magistral Small) and a Ministral 3 one (YaRN and a position-dependent query scale). What
the family modules share: tests/family_harness.py.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config
from ray_mmbatch.models import mistral3, token_ids
from tests import family_harness as h
from tests.family_harness import collate
from tests.hf_mistral3_checkpoint import LONGEST, MERGE, PATCH, make_mistral3_checkpoint, pixtral_processor

LONG = ("Tell me, in as many words as you like, what you see when you look at the long strip of noise with "
        "one bright red stripe across it, and why a stripe like that would be drawn there at all.")
# text only (long), one wide image (scaled down: 2 rows of 8), a thin one (8 rows of 1) with a square one (8 x 8)
# in one sample, a small one (stretched up: 4 rows of 3)
SPECS = [
    (LONG, "I see noise. The stripe marks a row, so that a wrong resize or crop would show.", []),
    ("<image>\nDescribe the picture in a few words please.", "A noisy strip with a bright stripe.", [(170, 45)]),
    ("<image>\n<image>\nCompare these two images.", "The first is a thin line, the second a square.",
     [(3, 100), (64, 64)]),
    ("<image>\nColour?", "Red on grey.", [(20, 30)]),
]
BLOCK = ("[IMG]", "[IMG][IMG_END]")

ckpt, cfg, tok, model, reference, tol = h.family_fixtures(
    mistral3, lambda d, text: make_mistral3_checkpoint(d, text), params=["mistral", "ministral3"],
    ids=["mistral", "ministral3"])


@pytest.fixture(scope="module")
def processor(ckpt):
    return pixtral_processor(ckpt)


def _hf_inputs(processor, user: str, answer: str, pics: list) -> dict:
    text = h.chat_text(processor.tokenizer, user, answer, len(pics))
    out = processor(text=text, images=pics or None, add_special_tokens=False, return_tensors="pt")
    kwargs = {"input_ids": out["input_ids"][0].tolist()}
    if pics:
        kwargs.update(pixel_values=out["pixel_values"], image_sizes=out["image_sizes"])
    return kwargs


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    """Samples through the pipeline's data path, with each one's HF processor inputs, and the measured rows."""
    samples, measured, decoded = h.through_the_data_path(h.spec_rows(SPECS), cfg, tok)
    return samples, [_hf_inputs(processor, u, a, d) for (u, a, _), d in zip(SPECS, decoded)], measured


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(model, built, tok):
    """ids (template, rows of [IMG] closed by [IMG_BREAK] / [IMG_END]), pixel_values and image_sizes equal the
    processor's, bit for bit; the cost measured from the headers is its token count exactly: rows x (cols + 1)
    tokens an image, rows x cols of them image tokens."""
    samples, hf, measured = built
    image_id = model.hf_model.config.image_token_id
    brk, end = (tok.convert_tokens_to_ids(t) for t in ("[IMG_BREAK]", "[IMG_END]"))
    for s, inputs in zip(samples, hf):
        assert s["input_ids"].tolist() == inputs["input_ids"]
        ours = model.forward_inputs(collate("pad", [s], tok.pad_token_id))
        if "pixel_values" not in inputs:
            assert "pixel_values" not in ours and len(s["patches"]) == 0
            continue
        assert torch.equal(ours["image_sizes"], inputs["image_sizes"])
        assert ours["pixel_values"].shape == inputs["pixel_values"].shape  # padded to the sample's largest
        assert torch.equal(ours["pixel_values"], inputs["pixel_values"])  # bit for bit
    ids = [np.asarray(i["input_ids"]) for i in hf]
    assert list(measured[S.TOKENS]) == [len(i) for i in ids]
    assert list(measured[S.IMAGE_TOKENS]) == [int((i == image_id).sum()) for i in ids]
    # (rows, cols) per image: (2, 8); (8, 1) and (8, 8); (4, 3)
    assert [int(t) for t in measured[S.IMAGE_TOKENS]] == [0, 16, 8 + 64, 12]
    assert [int((i == brk).sum()) for i in ids] == [0, 1, 7 + 7, 3]
    assert [int((i == end).sum()) for i in ids] == [0, 1, 2, 1]
    assert [s["grids"].tolist() for s in samples[1:]] == [[[1, 4, 16]], [[1, 16, 2], [1, 16, 16]], [[1, 8, 6]]]


@pytest.mark.parametrize("sizes", [[(h_, w) for h_ in (1, 2, 3, 7, 28, 45, 63, 64, 65, 100, 640, 4000)
                                    for w in (1, 2, 5, 8, 64, 150, 999, 3000)]])
def test_pixtral_resize_is_hfs_formula(cfg, sizes):
    """data/image/pixtral.py against HF's own get_resize_output_image_size (as PixtralProcessor calls it: patch size
    patch_size x spatial_merge_size) at the tiny and the published longest edges: the same target size; where a
    side scales to 0 pixels (HF's resize then fails) the image is skipped as extreme_aspect."""
    from transformers.models.pixtral.image_processing_pil_pixtral import get_resize_output_image_size

    from ray_mmbatch.data.image import ImageSkip, pixtral_resize

    for longest, ps in ((LONGEST, PATCH), (1540, 14)):
        icfg = copy.deepcopy(cfg.image)
        icfg.image_size, icfg.patch_size = longest, ps
        for hh, ww in sizes:
            want = get_resize_output_image_size(np.zeros((3, hh, ww)), (longest, longest), (ps * MERGE, ps * MERGE),
                                                input_data_format="channels_first")
            if 0 in want:
                with pytest.raises(ImageSkip) as e:
                    pixtral_resize(hh, ww, icfg)
                assert e.value.reason == S.SKIP_EXTREME_ASPECT
                continue
            assert pixtral_resize(hh, ww, icfg) == want, (hh, ww, longest)


def test_pixels_of_every_kind_of_file_are_hfs_bit_for_bit():
    """tests/test_image_hf's files (photos, grey, 16-bit, CMYK, alpha, palettes, EXIF-rotated, 1 x 1, thin, 2000 x
    1500) at the published settings (14-px patches merged 2 x 2, longest edge 1540): grid and pixel_values equal
    HF's PixtralImageProcessor (PIL backend, patch size 28 as PixtralProcessor passes it) bit for bit."""
    from transformers.models.pixtral.image_processing_pil_pixtral import PixtralImageProcessorPil

    from ray_mmbatch.config import ImageConfig
    from ray_mmbatch.data.image import decode_image, image_grid, patchify, probe_image
    from ray_mmbatch.models.hf_common import CLIP_MEAN, CLIP_STD
    from tests.test_image_hf import FILES, opened

    icfg = ImageConfig(resize="pixtral", image_size=1540, patch_size=14, merge_size=2, temporal_patch_size=1,
                       image_mean=CLIP_MEAN, image_std=CLIP_STD)
    hf = PixtralImageProcessorPil(size={"longest_edge": 1540}, patch_size={"height": 14, "width": 14})
    for name, data in FILES.items():
        ref = hf(images=opened(data), patch_size={"height": 28, "width": 28}, return_tensors="pt")
        grid = image_grid(*probe_image(data, icfg), icfg)
        patches = torch.from_numpy(patchify(decode_image(data, grid, icfg), icfg))
        ours, sizes = mistral3.pixel_values(patches, torch.tensor([grid]), 14, 2, CLIP_MEAN, CLIP_STD, torch.float32)
        assert sizes.tolist() == ref["image_sizes"].tolist(), name
        assert torch.equal(ours, ref["pixel_values"]), name


# ------------------------------------------------------------------ exactness and its controls
test_batch_equals_each_sample_alone = h.exactness_test()
test_flash_attention_gets_the_varlen_metadata = h.flash_varlen_test(lambda hf: hf.model.language_model.config)


def test_pack_is_exact_with_eager_attention(cfg, tok, built, reference, tol):
    """Packing detection lives in transformers' mask builder, so eager gets the same block-diagonal mask as sdpa."""
    h.check_pack_exact_with_eager(mistral3, cfg, tok, built[0], reference, lambda hf: hf.model.language_model.config,
                                  tol)


@pytest.mark.parametrize("naive", ["positions_not_restarting", "all_ones_mask", "use_cache", "tower_across_images"])
def test_naive_feeds_are_caught(model, built, reference, tok, tol, naive, monkeypatch):
    """Each naive feed of the packed row moves some target token's CE by more than 100 x the tolerance; the naive
    packed feed (one causal row, positions not restarting) by more than 0.1 nats. ``tower_across_images``: the
    Pixtral tower's per-image block mask replaced by one that lets every patch see every image's patches (the
    samples' images in one tower sequence), so its isolation is what the exactness test relies on."""
    batch = collate("pack", built[0], tok.pad_token_id)
    kwargs = h.naive_inputs(model, batch, naive)
    if naive == "tower_across_images":
        import transformers.models.pixtral.modeling_pixtral as pixtral

        blocks = pixtral.generate_block_attention_mask

        def one_block(lengths, tensor):
            return blocks([sum(lengths)], tensor)

        monkeypatch.setattr(pixtral, "generate_block_attention_mask", one_block)
    moved = h.check_caught(model, batch, kwargs, reference[0], naive, tol)
    if naive == "positions_not_restarting":
        assert moved > 0.1


def test_the_tower_keeps_the_images_of_a_batch_apart(model, built, tok):
    """Every image's projected features in the packed batch (all four images in one tower sequence) equal those of
    the image run through the tower alone."""
    batch = collate("pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    hf = model.hf_model.model
    with torch.no_grad():
        together = hf.get_image_features(kwargs["pixel_values"], kwargs["image_sizes"]).pooler_output
        assert len(together) == 4
        for i, feats in enumerate(together):
            (alone,) = hf.get_image_features(kwargs["pixel_values"][i:i + 1], kwargs["image_sizes"][i:i + 1]
                                             ).pooler_output
            assert (feats - alone).abs().max().item() < 1e-5, i


def test_a_batch_of_one_image_token_trains(model, cfg, tok, built, tol):
    """A 1 x 1 image is one image token; HF's own forward fails on a forward holding exactly one (it squeezes the
    features to 1-D), so the adapter computes them without the squeeze: the sample alone gives the CE it has when
    packed beside other images (HF's own path)."""
    from ray_mmbatch.data.materialize import materialize_sample
    from ray_mmbatch.data.measure import measure_batch

    raw = h.spec_rows([("<image>\nColour?", "Red.", [(1, 1)])])
    measured = measure_batch(raw, cfg.image, tok, cfg.text)
    one = materialize_sample({c: measured[c][0] for c in measured}, cfg.image)
    assert int(measured[S.IMAGE_TOKENS][0]) == 1 and one["grids"].tolist() == [[1, 2, 2]]
    alone = collate("pack", [one], tok.pad_token_id)
    kwargs = model.forward_inputs(alone)
    assert "pixel_values" not in kwargs and "mm_encoder_outputs" in kwargs
    x, sizes = mistral3.pixel_values(alone["patches"], alone["image_grid_thw"].reshape(-1, 3), PATCH, MERGE,
                                     cfg.image.image_mean, cfg.image.image_std, torch.float32)
    with torch.no_grad(), pytest.raises(RuntimeError, match="split_with_sizes"):  # HF's own path
        model.hf_model.model(input_ids=alone["input_ids"], position_ids=alone["position_ids"], pixel_values=x,
                             image_sizes=sizes)
    with torch.no_grad():
        ce_alone = model.target_ce(alone)
        ce_packed = model.target_ce(collate("pack", [one, built[0][1]], tok.pad_token_id))[:len(ce_alone)]
    assert (ce_alone - ce_packed).abs().max().item() < tol.ce
    ce_sum, n = model(alone, loss_only=True)
    ce_sum.backward()
    tower = model.hf_model.model.vision_tower.patch_conv.weight
    assert tower.grad is not None and tower.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


test_text_only_batch_and_every_trainable_weight_gets_a_gradient = h.text_only_test(0)
test_verify_packing = h.verify_packing_test(mistral3, 512)


def test_hfs_assistant_mask_is_what_trains(ckpt, processor):
    """The checkpoint's template with ``{% generation %}`` around each answer and its ``</s>`` (the published one has
    no blocks; the copy renders the same text): HF's ``return_assistant_tokens_mask`` on the processor's ids of
    tests/targets_reference's conversation (system turn, two images, three answers) marks exactly the tokens the
    data path trains (test_targets derives the same turns from prefix renders)."""
    from tests import targets_reference as R
    from tests.hf_mistral3_checkpoint import MISTRAL3

    marked = MISTRAL3
    for answer in ("message['content'] + eos_token", "message['content'][0]['text'] + eos_token"):
        old = "{{- " + answer + " }}"
        assert marked.count(old) == 1
        marked = marked.replace(old, "{% generation %}" + old + "{% endgeneration %}")
    msgs, tok = R.messages(), processor.tokenizer
    for i in range(1, len(msgs) + 1):
        assert tok.apply_chat_template(msgs[:i], tokenize=False, chat_template=marked) == \
            tok.apply_chat_template(msgs[:i], tokenize=False)
    ids, positions = R.assistant_mask_positions(processor, R.messages(R.pil_images()), marked)
    ours, labels = R.project_sample(ckpt)
    assert list(ids) == ours.tolist()
    assert positions == R.trained_positions(labels)
    assert tok.decode([ids[p] for p in positions]) == "".join(a + "</s>" for a in R.ANSWERS)


# ------------------------------------------------------------------ configure
def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    from ray_mmbatch.models.hf_common import CLIP_MEAN, CLIP_STD

    im = cfg.image
    assert (im.resize, im.patch_size, im.merge_size, im.temporal_patch_size, im.image_size) == \
        ("pixtral", PATCH, MERGE, 1, LONGEST)
    assert im.image_mean == CLIP_MEAN and im.image_std == CLIP_STD
    assert (cfg.text.tokenizer, cfg.text.image_token, cfg.text.image_block, cfg.text.image_break) == \
        (str(ckpt), "[IMG]", BLOCK, "[IMG_BREAK]")
    assert (cfg.text.video_token, cfg.text.family, im.video) == ("", "Mistral 3", "")  # no video for Mistral 3
    assert mistral3.configure(copy.deepcopy(cfg)).text == cfg.text  # idempotent
    smaller = h.configure(mistral3, ckpt, **{"image.image_size": 32})  # the longest edge: the user's choice
    assert smaller.image.image_size == 32


def test_configure_reads_a_nested_processor_config(cfg, ckpt, tmp_path):
    """A checkpoint saved by a newer processor (one processor_config.json, the image processor's settings nested
    under ``image_processor``, no preprocessor_config.json) configures as the published two-file layout does."""
    d = h.variant(ckpt, tmp_path)
    nested = json.loads((d / "processor_config.json").read_text())
    nested["image_processor"] = json.loads((d / "preprocessor_config.json").read_text())
    (d / "processor_config.json").write_text(json.dumps(nested))
    (d / "preprocessor_config.json").unlink()
    again = h.configure(mistral3, d)
    assert again.image == cfg.image
    assert (again.text.image_block, again.text.image_break) == (cfg.text.image_block, cfg.text.image_break)


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(mistral3, [
    ("image.merge_size", 1), ("image.patch_size", 16), ("image.resize", "budget"), ("text.image_token", "[IMG_END]"),
    ("image.image_mean", "0.5,0.5,0.5"), ("text.image_break", "[IMG_END]")])


@pytest.mark.parametrize("config,pre,proc,text,match", [
    (None, {"size": {"shortest_edge": 64}}, None, None, "longest-edge bound only"),
    (None, {"resample": 2}, None, None, "only bicubic"),
    (None, {"do_rescale": False}, None, None, "rescaled by 1/255"),
    (None, {"do_center_crop": True}, None, None, "do_center_crop"),
    (None, {"image_processor_type": "CLIPImageProcessor"}, None, None, "reproduces"),
    (None, {"size": {"longest_edge": 128}}, None, None, "RoPE covers 16"),
    (None, None, {"spatial_merge_size": 1}, None, "spatial_merge_size 1 but config.json has 2"),
    (None, None, {"patch_size": 8}, None, "patch_size 8 but config.json has 4"),
    (None, None, {"image_break_token": "[NOPE]"}, None, "not an added token"),
    (None, None, {"image_token": "[IMG_END]"}, None, "image_token_index"),
    (None, None, None, {"sliding_window": 16}, "sliding_window=16"),
    ({"model_type": "llava"}, None, None, None, "not Mistral 3"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, proc, text, match):
    d = h.variant(ckpt, tmp_path, config=config, pre=pre, proc=proc)
    if text:
        data = json.loads((d / "config.json").read_text())
        data["text_config"].update(text)
        (d / "config.json").write_text(json.dumps(data))
    h.assert_refuses(mistral3, d, match)


def test_configure_refuses_a_longest_edge_over_the_towers_rope(ckpt):
    with pytest.raises(ValueError, match="RoPE covers 16"):
        h.configure(mistral3, ckpt, **{"image.image_size": 72})


def test_create_model_refuses_unconfigured_data(cfg):
    smart = copy.deepcopy(cfg)
    smart.image.resize = "smart"
    with pytest.raises(ValueError, match="call configure"):
        mistral3.create_model(smart, token_ids(cfg))
    with pytest.raises(ValueError, match="model.path"):
        mistral3.configure(Config())


def test_a_video_sample_is_refused_naming_the_family(cfg, tok):
    """Mistral 3 takes no video: a video sample stops the run at measure, as for every image-only family."""
    from ray_mmbatch.data.measure import VideoRefused, measure_batch
    from ray_mmbatch.synthetic.video import clip_frames, encode_clip

    clip = encode_clip(clip_frames(4, 32, 32))
    raw = h.raw_rows(["v"], [[{"from": "human", "value": "<video>\nWhat?"}, {"from": "gpt", "value": "A clip."}]],
                     [[clip]], [["clip.mp4"]])
    with pytest.raises(VideoRefused, match=r"clip.mp4.*resize='pixtral'.*takes no video"):
        measure_batch(raw, cfg.image, tok, cfg.text)


# ------------------------------------------------------------------ export, registry, FSDP, LoRA / freeze, API
def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads with from_pretrained, computes the same logits and configures the
    same way."""
    again = h.check_export(mistral3, model, cfg, collate("pad", [built[0][1]], 0), tmp_path)
    assert again.image == cfg.image and again.text.image_block == BLOCK and again.text.image_break == "[IMG_BREAK]"


test_registry_finds_the_backend = h.registry_test(mistral3)


test_fsdp_units_are_the_decoder_layers_and_vision_is_apart = h.fsdp_layout_test(
    mistral3, 2, ["hf_model.model.vision_tower", "hf_model.model.multi_modal_projector"])


def test_freeze_parts_and_lora_keep_packing_exact(cfg, tok, built, tmp_path, tol):
    """--freeze: vision = the Pixtral tower, projector = multi_modal_projector (its patch merger included); LoRA
    (default: the language model's linear layers) trains adapters only, a packed batch stays exact against each
    sample alone through the adapted HF model, and the exported adapter reloads with PEFT."""
    h.check_freeze_and_lora(mistral3, cfg, tok, built[0], built[1], tmp_path,
                            {"vision": lambda n: ".vision_tower." in n,
                             "projector": lambda n: ".multi_modal_projector." in n}, ".self_attn.q_proj.", tol.ce)


test_the_public_api_loads_it = h.public_api_test(lambda c: c.text.image_block == BLOCK and c.image.resize == "pixtral")
