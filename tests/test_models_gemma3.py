"""Gemma 3 backend: configure() from a checkpoint, and packed / padded batches exactly equal to HF run per sample.

The reference is HF's own path, one sample at a time: the checkpoint's Gemma3Processor (its
tokenizer and PIL image processor, loaded apart: no torchvision) on the chat template's render
and the PIL images -> ``Gemma3ForConditionalGeneration(input_ids, pixel_values, attention_mask,
token_type_ids)`` -> logits -> shifted CE. Our side is the pipeline's: RAW rows -> measure_batch
(the chat template with the processor's image block) -> materialize_sample -> collate_pack /
collate_pad -> batch_to_torch -> HFModel.target_ce. Token ids, token types and pixels must equal
the processor's; every target token's CE must match within the family's tolerance in fp32, gradients too
(family_harness.TOLERANCE).
The tiny checkpoint (initializer_range 0.2, the zero-initialized projection redrawn) has a
sliding window of 12 tokens, shorter than a sample, and 16 tokens per image, so the controls --
a causal mask over the image blocks, HF's own packing from position ids, no sample boundaries,
no sliding window -- all move the loss far beyond the tolerance. What the family modules share:
tests/family_harness.py.
"""
from __future__ import annotations

import copy
import io
import json
from functools import partial

import pytest
import torch
from PIL import Image

from ray_mmbatch.config import Config
from ray_mmbatch.models import gemma3, token_ids
from tests import family_harness as h
from tests.family_harness import collate
from tests.hf_gemma3_checkpoint import PATCH, SLIDING_WINDOW, TOKENS_PER_IMAGE, make_gemma3_checkpoint

SIDE = 56
BLOCK = ("<start_of_image>", "\n\n<start_of_image><image_soft_token><end_of_image>\n\n")


def _image(w: int, hh: int, seed: int, mode: str = "RGB") -> bytes:
    return h.png(h.image(w, hh, seed, mode=mode))


# (id, conversation, images): 1, 2, 0, 1 images; answers ending in spaces (the template trims them);
# a grey image and a 2-px-wide one (squashed to the square as HF does)
SPECS = [
    ("one", [{"from": "human", "value": "<image>\nWhat is shown here?"},
             {"from": "gpt", "value": "Noise with a bright red stripe across it. "}], [_image(70, 45, 1)]),
    ("two", [{"from": "human", "value": "Compare <image> with <image> please.\n"},
             {"from": "gpt", "value": "The first is tall and grey, the second is a thin sliver.  "}],
     [_image(40, 90, 2, "L"), _image(2, 150, 3)]),
    ("text", [{"from": "human", "value": "Name three prime numbers."}, {"from": "gpt", "value": "Two, three, five."},
              {"from": "human", "value": "And the next one?"}, {"from": "gpt", "value": " Seven."}], []),
    ("square", [{"from": "human", "value": "<image> Colour?"}, {"from": "gpt", "value": "Mostly grey, some red."}],
     [_image(56, 56, 4)]),
]


ckpt, cfg, tok, model, reference, tol = h.family_fixtures(gemma3, lambda d: make_gemma3_checkpoint(d, image_size=SIDE))


_configure = partial(h.configure, gemma3)


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    hf_tok = AutoTokenizer.from_pretrained(str(ckpt))
    seq = json.loads((ckpt / "processor_config.json").read_text())["image_seq_length"]
    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(str(ckpt)), tokenizer=hf_tok,
                           chat_template=hf_tok.chat_template, image_seq_length=seq)


def _raw(specs) -> dict:
    return h.raw_rows([s[0] for s in specs], [s[1] for s in specs], [s[2] for s in specs],
                      [[f"{s[0]}/{j}" for j in range(len(s[2]))] for s in specs])


def _messages(conv: list[dict]) -> list[dict]:
    """A conversation as the chat template's messages: <image> -> an image part, the texts as they are."""
    out = []
    for turn in conv:
        content = []
        for j, part in enumerate(turn["value"].split("<image>")):
            if j:
                content.append({"type": "image"})
            if part:
                content.append({"type": "text", "text": part})
        out.append({"role": {"human": "user", "gpt": "assistant"}[turn["from"]], "content": content})
    return out


def _hf_inputs(processor, conv, images: list[bytes]) -> dict:
    """The checkpoint's processor on the template's render and the decoded images (HF's standard inputs)."""
    pics = [Image.open(io.BytesIO(b)) for b in images]
    text = processor.tokenizer.apply_chat_template(_messages(conv), tokenize=False)
    return processor(text=text, images=[pics] if pics else None, add_special_tokens=False, return_tensors="pt")


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    """Materialized samples of SPECS through the data path, and HF's inputs for each."""
    samples, _, _ = h.through_the_data_path(_raw(SPECS), cfg, tok)
    keys = ("input_ids", "attention_mask", "token_type_ids", "pixel_values")
    hf = [_hf_inputs(processor, conv, images) for _, conv, images in SPECS]
    return samples, [{k: inputs[k] for k in keys if k in inputs} for inputs in hf], hf


# ------------------------------------------------------------------ the data path is the processor's
def test_ids_token_types_and_pixels_equal_the_processor(model, built, tok):
    samples, _, hf_inputs = built
    for sample, inputs in zip(samples, hf_inputs):
        assert sample["input_ids"].tolist() == inputs["input_ids"][0].tolist()  # image block, trimmed answers
        ours = model.forward_inputs(collate("pad", [sample], tok.pad_token_id))
        assert torch.equal(ours["token_type_ids"], inputs["token_type_ids"].long())
        if "pixel_values" in inputs:
            assert (ours["pixel_values"] - inputs["pixel_values"]).abs().max().item() < 1e-5
        else:
            assert "pixel_values" not in ours
    n = [int((s["input_ids"] == model.hf_model.config.image_token_id).sum()) for s in samples]
    assert n == [TOKENS_PER_IMAGE * len(images) for _, _, images in SPECS]
    # the blank lines before the image merged with the template's newline into one token: expanding the
    # template's <start_of_image> token by token (instead of in the text) would not give the processor's ids
    ids = samples[0]["input_ids"].tolist()
    boi = ids.index(model.hf_model.config.boi_token_id)
    assert tok.decode(ids[boi - 1:boi]) == "\n\n\n"


# ------------------------------------------------------------------ exactness
test_batch_equals_each_sample_alone = h.exactness_test()


def test_pack_is_exact_with_eager_attention(cfg, built, reference, tok, tol):
    """The masks come from transformers' mask builder, so eager gets them in its own (additive) format."""
    h.check_pack_exact_with_eager(gemma3, cfg, tok, built[0], reference, lambda hf: hf.config.get_text_config(), tol)


@pytest.mark.parametrize("naive", ["causal_image_blocks", "hf_position_id_packing", "no_sample_boundaries",
                                   "no_sliding_window", "pad_without_token_types"])
def test_naive_feeds_are_caught(model, built, reference, tok, tol, naive):
    """The tolerance is meaningful: each naive feed moves some target token's CE by more than 100 x it (none of
    them is refused)."""
    batch = collate("pad" if naive == "pad_without_token_types" else "pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    if naive == "causal_image_blocks":  # no image block: every image token causal
        kwargs["attention_mask"] = model._adapter.packed_masks(batch, torch.zeros_like(batch["input_ids"]))
    elif naive == "hf_position_id_packing":  # HF finds the samples from the restarting position ids itself
        del kwargs["attention_mask"]
    elif naive == "no_sample_boundaries":  # one causal row with image blocks: HF's single-sample path
        del kwargs["attention_mask"]
        kwargs["position_ids"] = torch.arange(batch["input_ids"].shape[1])[None]
    elif naive == "no_sliding_window":
        kwargs["attention_mask"]["sliding_attention"] = kwargs["attention_mask"]["full_attention"]
    else:
        del kwargs["token_type_ids"]
    h.check_caught(model, batch, kwargs, reference[0], naive, tol)


def test_packed_masks_keep_samples_apart_and_image_blocks_whole(model, built, tok):
    """The sdpa masks themselves: no entry across samples, each image block all-to-all, the window on sliding."""
    batch = collate("pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    full, sliding = (kwargs["attention_mask"][k][0, 0] for k in ("full_attention", "sliding_attention"))
    sample = torch.repeat_interleave(torch.arange(len(built[0])), batch["seq_lens"].long())
    assert not (full & (sample[:, None] != sample[None, :])).any()
    image = kwargs["token_type_ids"][0].bool()
    q, k = torch.nonzero(full & ~torch.ones_like(full).tril()).unbind(1)  # every future entry is inside a block
    assert image[q].all() and image[k].all() and (sample[q] == sample[k]).all()
    first = int(torch.nonzero(image)[0])
    block = slice(first, first + TOKENS_PER_IMAGE)
    assert full[block, block].all()
    t = torch.arange(full.shape[0])
    assert torch.equal(sliding, full & (t[None, :] > t[:, None] - SLIDING_WINDOW))


test_text_only_batch_and_every_trainable_weight_gets_a_gradient = h.text_only_test(2)


def test_verify_packing_command_passes(ckpt, tmp_path_factory, capsys, tol):
    """The verify-packing command on synthetic data through the real data path (local_batches), pack mode."""
    report = h.verify_packing(ckpt, h.generated_data(tmp_path_factory, "gemma3_verify_data", 12, seed=3), "pack",
                              1024, capsys, tol)
    assert report["samples"] > 5


# ------------------------------------------------------------------ configure
def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.temporal_patch_size) == \
        ("squash", SIDE, PATCH, (SIDE // PATCH) // int(TOKENS_PER_IMAGE ** 0.5), 1)
    assert im.image_mean == (0.5,) * 3 and im.image_std == (0.5,) * 3
    assert (cfg.text.tokenizer, cfg.text.image_token, cfg.text.image_block) == (str(ckpt), "<image_soft_token>", BLOCK)
    same = _configure(ckpt, **{"image.merge_size": 2, "text.image_token": "<image_soft_token>"})
    assert same.image.resize == "squash" and same.text.image_block == BLOCK
    assert gemma3.configure(copy.deepcopy(cfg)).text == cfg.text  # idempotent


test_configure_refuses_contradicting_settings = h.contradicting_settings_test(gemma3, [
    ("image.merge_size", 4), ("image.image_size", 224), ("image.patch_size", 16), ("image.resize", "fixed"),
    ("text.image_token", "<start_of_image>"), ("image.image_mean", "0.1,0.1,0.1")])


@pytest.mark.parametrize("config,pre,proc,match", [
    (None, {"do_pan_and_scan": True}, None, "do_pan_and_scan=true is not supported"),
    (None, {"size": {"height": 56, "width": 42}}, None, "not a square"),
    (None, {"resample": 3}, None, "only bilinear"),
    (None, {"size": {"height": 42, "width": 42}}, None, "vision tower takes 56"),
    (None, None, {"image_seq_length": 256}, "image_seq_length=256"),
    ({"mm_tokens_per_image": 15}, None, None, "not a square that divides"),
    ({"model_type": "llava"}, None, None, "not Gemma 3"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, proc, match):
    h.assert_refuses(gemma3, h.variant(ckpt, tmp_path, config=config, pre=pre, proc=proc), match)


def test_create_model_refuses_flash_attention_and_unconfigured_data(cfg):
    flash = copy.deepcopy(cfg)
    flash.model.attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="does not run on flash_attention_2"):
        gemma3.create_model(flash, token_ids(cfg))
    smart = copy.deepcopy(cfg)
    smart.image.resize = "smart"
    with pytest.raises(ValueError, match="call configure"):
        gemma3.create_model(smart, token_ids(cfg))
    with pytest.raises(ValueError, match="model.path"):
        gemma3.configure(Config())


def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    again = h.check_export(gemma3, model, cfg, collate("pad", [built[0][0]], 0), tmp_path)
    assert (again.image.resize, again.image.merge_size, again.text.image_block) == ("squash", 2, BLOCK)


test_registry_finds_the_backend = h.registry_test(gemma3)
