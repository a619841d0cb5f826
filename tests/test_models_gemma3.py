"""Gemma 3 backend: configure() from a checkpoint, and packed / padded batches exactly equal to HF run per sample.

The reference is HF's own path, one sample at a time: the checkpoint's Gemma3Processor (its
tokenizer and PIL image processor, loaded apart: no torchvision) on the chat template's render
and the PIL images -> ``Gemma3ForConditionalGeneration(input_ids, pixel_values, attention_mask,
token_type_ids)`` -> logits -> shifted CE. Our side is the pipeline's: RAW rows -> measure_batch
(the chat template with the processor's image block) -> materialize_sample -> collate_pack /
collate_pad -> batch_to_torch -> HFModel.target_ce. Token ids, token types and pixels must equal
the processor's; every target token's CE must match within 1e-4 nats in fp32, gradients too.
The tiny checkpoint (initializer_range 0.2, the zero-initialized projection redrawn) has a
sliding window of 12 tokens, shorter than a sample, and 16 tokens per image, so the controls --
a causal mask over the image blocks, HF's own packing from position ids, no sample boundaries,
no sliding window -- all move the loss far beyond the tolerance.
"""
from __future__ import annotations

import copy
import io
import json
import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.batching.collate import collate_pack, collate_pad
from ray_mmbatch.config import Config
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.measure import measure_batch
from ray_mmbatch.data.text.encoder import tokenizer_for
from ray_mmbatch.models import gemma3, token_ids
from ray_mmbatch.train.step import batch_to_torch
from tests.hf_gemma3_checkpoint import PATCH, SLIDING_WINDOW, TOKENS_PER_IMAGE, make_gemma3_checkpoint

SIDE = 56
TOL = 1e-4
BLOCK = ("<start_of_image>", "\n\n<start_of_image><image_soft_token><end_of_image>\n\n")


def _image(w: int, h: int, seed: int, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[h // 3: h // 3 + 2, :, 0] = 255  # a stripe, so the resize matters
    img = Image.fromarray(a).convert(mode)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


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


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"), image_size=SIDE)


def _configure(path, **overrides):
    from ray_mmbatch.config import apply_overrides

    c = Config()
    c.model.path = str(path)
    return gemma3.configure(apply_overrides(c, overrides))


@pytest.fixture(scope="module")
def cfg(ckpt):
    return _configure(ckpt)


@pytest.fixture(scope="module")
def tok(cfg):
    return tokenizer_for(cfg.text)


@pytest.fixture(scope="module")
def model(cfg):
    return gemma3.create_model(cfg, token_ids(cfg)).eval()


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    hf_tok = AutoTokenizer.from_pretrained(str(ckpt))
    seq = json.loads((ckpt / "processor_config.json").read_text())["image_seq_length"]
    return Gemma3Processor(image_processor=Gemma3ImageProcessorPil.from_pretrained(str(ckpt)), tokenizer=hf_tok,
                           chat_template=hf_tok.chat_template, image_seq_length=seq)


def _raw(specs) -> dict:
    return {S.SAMPLE_ID: [s[0] for s in specs], S.CONVERSATIONS: [json.dumps(s[1]) for s in specs],
            S.IMAGES: [s[2] for s in specs], S.IMAGE_REFS: [[f"{s[0]}/{j}" for j in range(len(s[2]))] for s in specs],
            S.READ_ERROR: [""] * len(specs)}


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
    measured = measure_batch(_raw(SPECS), cfg.image, tok, cfg.text)
    assert not any(measured[S.SKIP_REASON]), list(measured[S.SKIP_REASON])
    samples = [materialize_sample({c: measured[c][i] for c in measured}, cfg.image) for i in range(len(SPECS))]
    return samples, [_hf_inputs(processor, conv, images) for _, conv, images in SPECS]


def _reference_ce(model, sample: dict, inputs: dict) -> torch.Tensor:
    """HF's standard path for ONE sample: full logits, shifted CE at the target positions."""
    kwargs = {k: inputs[k] for k in ("input_ids", "attention_mask", "token_type_ids", "pixel_values") if k in inputs}
    logits = model.hf_model(**kwargs).logits[0]
    labels = torch.as_tensor(sample["labels"], dtype=torch.long)
    at = torch.nonzero(labels != S.IGNORE_INDEX).flatten()
    ids = inputs["input_ids"][0]
    assert torch.equal(labels[at], ids[at + 1])  # labels are the next tokens: the test's shift is HF's
    return F.cross_entropy(logits[at].float(), ids[at + 1], reduction="none")


def _collate(mode: str, samples: list[dict], pad_id: int) -> dict:
    return batch_to_torch((collate_pack if mode == "pack" else collate_pad)(samples, pad_id), "cpu")


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def reference(model, built):
    """Per-target CE of every sample alone (concatenated in sample order) and the gradient of their sum."""
    model.zero_grad(set_to_none=True)
    ces = []
    for sample, inputs in zip(*built):
        ce = _reference_ce(model, sample, inputs)
        ce.sum().backward()
        ces.append(ce.detach())
    return torch.cat(ces), _grads(model)


# ------------------------------------------------------------------ the data path is the processor's
def test_ids_token_types_and_pixels_equal_the_processor(model, built, tok):
    samples, hf_inputs = built
    for sample, inputs in zip(samples, hf_inputs):
        assert sample["input_ids"].tolist() == inputs["input_ids"][0].tolist()  # image block, trimmed answers
        ours = model.forward_inputs(_collate("pad", [sample], tok.pad_token_id))
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
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_batch_equals_each_sample_alone(model, built, reference, tok, mode):
    samples, _ = built
    ref_ce, ref_grads = reference
    ce = model.target_ce(_collate(mode, samples, tok.pad_token_id))
    assert ce.shape == ref_ce.shape
    diff = (ce.detach() - ref_ce).abs().max().item()
    print(f"{mode}: {ce.numel()} target tokens, max per-token CE diff {diff:.2e}")
    assert diff < TOL
    ce.sum().backward()
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    # per parameter, relative to its own norm, with a floor of 1e-3 of the whole gradient's norm (weights whose
    # gradient is exactly zero in exact arithmetic carry float noise only)
    floor = 1e-3 * torch.sqrt(sum(g.norm() ** 2 for g in ref_grads.values()))
    rel = {n: ((grads[n] - g).norm() / torch.maximum(g.norm(), floor)).item() for n, g in ref_grads.items()}
    worst = max(rel.values())
    print(f"{mode}: worst per-parameter relative gradient diff {worst:.2e}")
    assert worst < TOL


def test_pack_is_exact_with_eager_attention(cfg, built, reference, tok):
    """The masks come from transformers' mask builder, so eager gets them in its own (additive) format."""
    eager_cfg = copy.deepcopy(cfg)
    eager_cfg.model.attn_implementation = "eager"
    eager = gemma3.create_model(eager_cfg, token_ids(cfg)).eval()
    assert eager.hf_model.config.get_text_config()._attn_implementation == "eager"
    with torch.no_grad():
        ce = eager.target_ce(_collate("pack", built[0], tok.pad_token_id))
    assert (ce - reference[0]).abs().max().item() < TOL


def _ce_with(model, batch, kwargs) -> torch.Tensor:
    hidden = model.hf_model.model(**kwargs, use_cache=False).last_hidden_state
    is_target = batch["labels"] != S.IGNORE_INDEX
    return F.cross_entropy(model.hf_model.lm_head(hidden[is_target]).float(), batch["labels"][is_target],
                           reduction="none")


@pytest.mark.parametrize("naive", ["causal_image_blocks", "hf_position_id_packing", "no_sample_boundaries",
                                   "no_sliding_window", "pad_without_token_types"])
def test_naive_feeds_are_caught(model, built, reference, tok, naive):
    """The tolerance is meaningful: each naive feed moves some target token's CE far beyond it."""
    samples, _ = built
    batch = _collate("pad" if naive == "pad_without_token_types" else "pack", samples, tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    kwargs.pop("use_cache")
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
    with torch.no_grad():
        diff = (_ce_with(model, batch, kwargs) - reference[0]).abs().max().item()
    print(f"naive {naive}: max per-token CE diff {diff:.2e}")
    assert diff > 100 * TOL, f"{naive}: CE moved only {diff:.2e}, so the exactness test could not fail"


def test_packed_masks_keep_samples_apart_and_image_blocks_whole(model, built, tok):
    """The sdpa masks themselves: no entry across samples, each image block all-to-all, the window on sliding."""
    batch = _collate("pack", built[0], tok.pad_token_id)
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


def test_text_only_batch_and_every_trainable_weight_gets_a_gradient(model, built, tok):
    samples, _ = built
    text_only = _collate("pack", [samples[2]], tok.pad_token_id)
    assert len(samples[2]["patches"]) == 0 and "pixel_values" not in model.forward_inputs(text_only)
    for batch in (text_only, _collate("pad", samples, tok.pad_token_id)):
        ce_sum, n = model(batch, loss_only=True)
        assert int(n) == int((batch["labels"] != S.IGNORE_INDEX).sum())
        ce_sum.backward()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == set(_grads(model))  # DDP: no trainable weight left out of the graph


def test_verify_packing_command_passes(ckpt, tmp_path, capsys):
    """The verify-packing command on synthetic data through the real data path (local_batches), pack mode."""
    from ray_mmbatch.commands.verify_packing import main
    from ray_mmbatch.synthetic.generate import generate_dataset

    generate_dataset(str(tmp_path / "data"), 12, "parquet", seed=3, shard_size=12)
    rc = main(["--model", str(ckpt), "--data", str(tmp_path / "data"), "--mode", "pack", "--max-tokens", "1024",
               "--batches", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0 and report["ok"] and report["samples"] > 5 and report["max_abs_diff"] < TOL, report


# ------------------------------------------------------------------ configure
def _variant(ckpt, tmp_path, config: dict | None = None, pre: dict | None = None, proc: dict | None = None):
    """A copy of the checkpoint's JSON / tokenizer files (no weights: configure reads none) with fields changed."""
    d = tmp_path / "variant"
    d.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    for name, change in (("config.json", config), ("preprocessor_config.json", pre), ("processor_config.json", proc)):
        if change:
            data = json.loads((d / name).read_text())
            data.update(change)
            (d / name).write_text(json.dumps(data))
    return d


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.temporal_patch_size) == \
        ("squash", SIDE, PATCH, (SIDE // PATCH) // int(TOKENS_PER_IMAGE ** 0.5), 1)
    assert im.image_mean == (0.5,) * 3 and im.image_std == (0.5,) * 3
    assert (cfg.text.tokenizer, cfg.text.image_token, cfg.text.image_block) == (str(ckpt), "<image_soft_token>", BLOCK)
    same = _configure(ckpt, **{"image.merge_size": 2, "text.image_token": "<image_soft_token>"})
    assert same.image.resize == "squash" and same.text.image_block == BLOCK
    assert gemma3.configure(copy.deepcopy(cfg)).text == cfg.text  # idempotent


@pytest.mark.parametrize("key,value", [("image.merge_size", 4), ("image.image_size", 224), ("image.patch_size", 16),
                                       ("image.resize", "fixed"), ("text.image_token", "<start_of_image>"),
                                       ("image.image_mean", "0.1,0.1,0.1")])
def test_configure_refuses_contradicting_settings(ckpt, key, value):
    with pytest.raises(ValueError, match=rf"{re.escape(key)} = .*contradicts the checkpoint"):
        _configure(ckpt, **{key: value})


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
    with pytest.raises(ValueError, match=match):
        _configure(_variant(ckpt, tmp_path, config=config, pre=pre, proc=proc))


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
    from transformers import AutoModelForImageTextToText

    out = gemma3.export(model, cfg, tmp_path / "hf")
    batch = _collate("pad", [built[0][0]], 0)
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    kwargs = model.forward_inputs(batch)
    with torch.no_grad():
        a = model.hf_model(**kwargs).logits
        b = back(**kwargs).logits
    assert (a - b).abs().max().item() < 1e-5
    again = _configure(out)
    assert (again.image.resize, again.image.merge_size, again.text.image_block) == ("squash", 2, BLOCK)


def test_registry_finds_the_backend(ckpt):
    from ray_mmbatch.config import ModelConfig
    from ray_mmbatch.models import backend_name

    assert backend_name(ModelConfig(path=str(ckpt))) == "gemma3"
