"""LLaVA backend: configure() from a checkpoint, and packed / padded batches exactly equal to HF run per sample.

The reference is HF's own path, one sample at a time: ``LlavaForConditionalGeneration(input_ids,
pixel_values=<the checkpoint's CLIP image processor on the PIL image>, attention_mask=ones)`` ->
logits -> shifted CE. Our side is the pipeline's: sample dicts -> collate_pack / collate_pad ->
batch_to_torch -> HFModel.target_ce. A tiny random checkpoint with initializer_range 0.2 makes
a wrong mask or wrong position ids move the loss by far more than the tolerance (checked below).
"""
from __future__ import annotations

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
from ray_mmbatch.config import Config, ImageConfig
from ray_mmbatch.data.image import patchify
from ray_mmbatch.data.text.tokenizer import load_tokenizer
from ray_mmbatch.models import llava
from ray_mmbatch.train.step import batch_to_torch
from tests.hf_llava_checkpoint import make_llava_checkpoint

SIDE, PS = 56, 14
N = (SIDE // PS) ** 2  # image tokens per image
TOL = 1e-4

# (question, answer, image sizes (w, h)): 0, 1, 2, 1 images, different text lengths
SPECS = [
    ("What is two plus two?", "Four.", []),
    ("Describe the picture in a few words please.", "A noisy square with a bright stripe across it.", [(70, 45)]),
    ("Compare these two images.", "The first is tall, the second is wide; both are noise.", [(40, 90), (100, 33)]),
    ("Colour?", "Mostly grey with some red, honestly hard to tell from so few pixels here.", [(56, 56)]),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llava_checkpoint(tmp_path_factory.mktemp("llava"), image_size=SIDE)


@pytest.fixture(scope="module")
def cfg(ckpt):
    c = Config()
    c.model.path = str(ckpt)
    return llava.configure(c)


@pytest.fixture(scope="module")
def tok(cfg):
    return load_tokenizer(cfg.text.tokenizer)


@pytest.fixture(scope="module")
def model(cfg, tok):
    m = llava.create_model(cfg, _ids(cfg, tok))
    return m.eval()  # no dropout in this checkpoint either way; eval keeps HF from warning


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import CLIPImageProcessorPil

    return CLIPImageProcessorPil.from_pretrained(str(ckpt))


def _ids(cfg, tok) -> dict:
    return {"vocab_size": len(tok), "image_token_id": tok.convert_tokens_to_ids(cfg.text.image_token),
            "pad_id": tok.pad_token_id}


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[h // 3: h // 3 + 4, :, 0] = 255  # a stripe, so resize and crop offsets matter
    return Image.fromarray(a)


def _hand_built(tok, processor, image_token_id: int) -> tuple[list[dict], list[list[Image.Image]]]:
    """Sample dicts as materialize makes them, with the processor's own resized + cropped uint8 pixels."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    samples, images = [], []
    for i, (question, answer, sizes) in enumerate(SPECS):
        pics = [_image(w, h, seed=10 * i + j) for j, (w, h) in enumerate(sizes)]
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


def _reference_ce(model, processor, sample: dict, pics: list) -> torch.Tensor:
    """HF's standard path for ONE sample: full logits, shifted CE at the target positions."""
    hf = model.hf_model
    ids = torch.as_tensor(sample["input_ids"], dtype=torch.long)[None]
    pixels = processor(pics, return_tensors="pt")["pixel_values"] if pics else None
    logits = hf(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids)).logits[0]
    labels = torch.as_tensor(sample["labels"], dtype=torch.long)
    at = torch.nonzero(labels != S.IGNORE_INDEX).flatten()
    assert torch.equal(labels[at], ids[0, at + 1])  # labels are the next tokens: the test's shift is HF's
    return F.cross_entropy(logits[at].float(), ids[0, at + 1], reduction="none")


def _collate(mode: str, samples: list[dict], pad_id: int) -> dict:
    batch = (collate_pack if mode == "pack" else collate_pad)(samples, pad_id)
    return batch_to_torch(batch, "cpu")


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def built(tok, processor, cfg):
    return _hand_built(tok, processor, tok.convert_tokens_to_ids(cfg.text.image_token))


@pytest.fixture(scope="module")
def reference(model, processor, built):
    """Per-target CE of every sample alone (concatenated in sample order) and the gradient of their sum."""
    samples, images = built
    model.zero_grad(set_to_none=True)
    ces = []
    for s, pics in zip(samples, images):
        ce = _reference_ce(model, processor, s, pics)
        ce.sum().backward()
        ces.append(ce.detach())
    return torch.cat(ces), _grads(model)


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_batch_equals_each_sample_alone(model, built, reference, tok, mode):
    samples, _ = built
    ref_ce, ref_grads = reference
    batch = _collate(mode, samples, tok.pad_token_id)
    ce = model.target_ce(batch)
    assert ce.shape == ref_ce.shape
    diff = (ce.detach() - ref_ce).abs().max().item()
    print(f"{mode}: {ce.numel()} target tokens, max per-token CE diff {diff:.2e}")
    assert diff < TOL
    ce.sum().backward()
    grads = _grads(model)
    assert grads.keys() == ref_grads.keys()
    # per parameter, relative to its own norm; attention key biases have an exactly-zero gradient (softmax is
    # shift-invariant), so their float noise is measured against a floor of 1e-3 of the whole gradient's norm
    floor = 1e-3 * torch.sqrt(sum(g.norm() ** 2 for g in ref_grads.values()))
    rel = {n: ((grads[n] - g).norm() / torch.maximum(g.norm(), floor)).item() for n, g in ref_grads.items()}
    worst = max(rel.values())
    print(f"{mode}: worst per-parameter relative gradient diff {worst:.2e}")
    assert worst < TOL


def test_flash_attention_gets_the_varlen_metadata(model, built, reference, tok):
    """Flash attention gets the packed row's cu_seq_lens / max_length explicitly (not inferred from ids)."""
    from tests.varlen_check import check_varlen

    samples, _ = built
    batch = _collate("pack", samples, tok.pad_token_id)
    diff = check_varlen(model, model.hf_model.model.language_model.config, batch, reference[0], TOL)
    print(f"pack on recorded varlen kwargs: max per-token CE diff {diff:.2e}")
    assert "cu_seq_lens_q" not in model.forward_inputs(_collate("pad", samples, tok.pad_token_id))


def test_pack_is_exact_with_eager_attention(cfg, tok, built, reference):
    """Packing detection lives in transformers' mask builder, so eager gets the same block-diagonal mask as sdpa."""
    import copy

    eager_cfg = copy.deepcopy(cfg)
    eager_cfg.model.attn_implementation = "eager"
    eager = llava.create_model(eager_cfg, _ids(cfg, tok)).eval()
    assert eager.hf_model.model.language_model.config._attn_implementation == "eager"
    with torch.no_grad():
        ce = eager.target_ce(_collate("pack", built[0], tok.pad_token_id))
    assert (ce - reference[0]).abs().max().item() < TOL


def _naive_ce(model, batch, **override) -> torch.Tensor:
    kwargs = model.forward_inputs(batch)
    kwargs.update(override)
    hidden = model.hf_model.model(**kwargs).last_hidden_state
    is_target = batch["labels"] != S.IGNORE_INDEX
    logits = model.hf_model.lm_head(hidden[is_target]).float()
    return F.cross_entropy(logits, batch["labels"][is_target], reduction="none")


@pytest.mark.parametrize("naive", ["positions_not_restarting", "use_cache", "all_ones_mask"])
def test_naive_packing_is_caught(model, built, reference, tok, naive):
    """The tolerance is meaningful: feeding the packed row the naive ways moves the CE far beyond it."""
    samples, _ = built
    batch = _collate("pack", samples, tok.pad_token_id)
    t = batch["input_ids"].shape[1]
    override = {"positions_not_restarting": {"position_ids": torch.arange(t)[None]},
                "use_cache": {"use_cache": True},
                "all_ones_mask": {"attention_mask": torch.ones(1, t, dtype=torch.bool)}}[naive]
    with torch.no_grad():
        diff = (_naive_ce(model, batch, **override) - reference[0]).abs().max().item()
    print(f"naive {naive}: max per-token CE diff {diff:.2e}")
    assert diff > 100 * TOL, f"{naive}: CE moved only {diff:.2e}, so the exactness test could not fail"


def test_text_only_batch_and_every_trainable_weight_gets_a_gradient(model, built, tok):
    samples, _ = built
    assert len(samples[0]["patches"]) == 0
    text_only = _collate("pack", [samples[0]], tok.pad_token_id)
    assert "pixel_values" not in model.forward_inputs(text_only)
    for batch in (text_only, _collate("pad", samples, tok.pad_token_id)):
        ce_sum, n = model(batch, loss_only=True)
        assert int(n) == int((batch["labels"] != S.IGNORE_INDEX).sum())
        ce_sum.backward()
        grads = _grads(model)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == set(grads)  # DDP: no trainable weight left out of the graph
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all("vision_tower.encoder.layers.1." in n or "post_layernorm" in n for n in frozen)


@pytest.fixture(scope="module")
def padded_variant(ckpt, tmp_path_factory):
    """The checkpoint with LLaVA's own image processor, do_pad on (pad to a square of the mean colour first)."""
    from transformers import LlavaImageProcessorPil

    d = _variant(ckpt, tmp_path_factory.mktemp("llava_pad"))
    LlavaImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE},
                           do_pad=True).save_pretrained(d)
    return d


@pytest.mark.parametrize("kind", ["clip_crop", "llava_do_pad"])
def test_through_the_data_path(model, processor, cfg, tok, padded_variant, kind):
    """measure_batch + materialize_sample (the pipeline's own pixels and tokens) vs HF on the decoded image."""
    from transformers import LlavaImageProcessorPil

    from ray_mmbatch.data.materialize import materialize_sample
    from ray_mmbatch.data.measure import measure_batch

    if kind == "llava_do_pad":  # same weights, so the model fixture serves; only the pixels differ
        cfg = _configure(padded_variant)
        assert cfg.image.resize == "fixed_pad"
        processor = LlavaImageProcessorPil.from_pretrained(str(padded_variant))
    pics = [_image(70, 45, 1), _image(40, 90, 2), _image(100, 33, 3)]
    pngs = []
    for p in pics:
        buf = io.BytesIO()
        p.save(buf, format="PNG")
        pngs.append(buf.getvalue())
    convs = [[{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise, mostly."}],
             [{"from": "human", "value": "Two: <image> and <image>"}, {"from": "gpt", "value": "Both are noise."}],
             [{"from": "human", "value": "No picture here."}, {"from": "gpt", "value": "Then nothing to see."}]]
    raw = {S.SAMPLE_ID: ["a", "b", "c"], S.CONVERSATIONS: [json.dumps(c) for c in convs],
           S.IMAGES: [[pngs[0]], pngs[1:], []], S.IMAGE_REFS: [["0.png"], ["1.png", "2.png"], []],
           S.READ_ERROR: ["", "", ""]}
    measured = measure_batch(raw, cfg.image, tok, cfg.text)
    assert not any(measured[S.SKIP_REASON]), list(measured[S.SKIP_REASON])
    grid = [1, SIDE // PS, SIDE // PS]
    assert [np.asarray(g).reshape(-1, 3).tolist() for g in measured[S.GRIDS]] == [[grid], [grid, grid], []]
    assert list(measured[S.TOKENS]) == [len(t) - n + n * N for t, n in zip(measured[S.TEXT_IDS], (1, 2, 0))]
    image_id = tok.convert_tokens_to_ids(cfg.text.image_token)
    assert int(measured[S.IMAGE_TOKEN_ID][0]) == image_id
    samples = [materialize_sample({c: measured[c][i] for c in measured}, cfg.image) for i in range(3)]
    assert [int((s["input_ids"] == image_id).sum()) for s in samples] == [N, 2 * N, 0]
    decoded = [[Image.open(io.BytesIO(b)) for b in raw[S.IMAGES][i]] for i in range(3)]
    with torch.no_grad():
        ref = torch.cat([_reference_ce(model, processor, s, d) for s, d in zip(samples, decoded)])
        for mode in ("pack", "pad"):
            diff = (model.target_ce(_collate(mode, samples, tok.pad_token_id)) - ref).abs().max().item()
            print(f"data path {kind}, {mode}: max per-token CE diff {diff:.2e}")
            assert diff < TOL


# ------------------------------------------------------------------ configure
def _variant(ckpt, tmp_path, config: dict | None = None, pre: dict | None = None):
    """A copy of the checkpoint's JSON / tokenizer files (no weights: configure reads none) with fields changed."""
    d = tmp_path / "variant"
    d.mkdir()
    for f in ckpt.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, d / f.name)
    for name, change in (("config.json", config), ("preprocessor_config.json", pre)):
        if change:
            data = json.loads((d / name).read_text())
            data.update(change)
            (d / name).write_text(json.dumps(data))
    return d


def _configure(path, **overrides):
    from ray_mmbatch.config import apply_overrides

    c = Config()
    c.model.path = str(path)
    return llava.configure(apply_overrides(c, overrides))


def test_configure_takes_the_checkpoint_settings(cfg, ckpt, tmp_path):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.temporal_patch_size) == ("fixed", SIDE, PS, 1, 1)
    assert im.image_mean == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert (cfg.text.tokenizer, cfg.text.image_token) == (str(ckpt), "<image>")
    own = _configure(_variant(ckpt, tmp_path, pre={"image_mean": [0.5, 0.5, 0.5], "image_std": [0.25, 0.25, 0.25]}))
    assert (own.image.image_mean, own.image.image_std) == ((0.5,) * 3, (0.25,) * 3)
    # settings equal to the checkpoint's are fine; so is a tokenizer of the user's own
    same = _configure(ckpt, **{"image.image_size": SIDE, "image.merge_size": 1, "text.image_token": "<image>",
                               "text.tokenizer": str(ckpt)})
    assert same.image.resize == "fixed"


@pytest.mark.parametrize("key,value", [("image.merge_size", 4), ("image.image_size", 224), ("image.patch_size", 16),
                                       ("image.image_mean", "0.5,0.5,0.5"), ("text.image_token", "<img>"),
                                       ("image.temporal_patch_size", 2)])
def test_configure_refuses_contradicting_settings(ckpt, key, value):
    with pytest.raises(ValueError, match=rf"{re.escape(key)} = .*contradicts the checkpoint"):
        _configure(ckpt, **{key: value})


@pytest.mark.parametrize("config,pre,match", [
    ({"vision_feature_select_strategy": "full"}, None, "vision_feature_select_strategy='full'"),
    (None, {"do_pad": True}, "do_pad=true outside LlavaImageProcessor"),
    (None, {"crop_size": {"height": 42, "width": 42}}, "shortest_edge 56 != crop 42"),
    (None, {"size": {"shortest_edge": 42}, "crop_size": {"height": 42, "width": 42}}, "vision tower takes 56"),
    (None, {"size": {"height": 56, "width": 56}}, "not a fixed-resize setting"),
    (None, {"resample": 2}, "bicubic"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, match):
    with pytest.raises(ValueError, match=match):
        _configure(_variant(ckpt, tmp_path, config=config, pre=pre))


def test_configure_refuses_other_model_types_and_no_path(ckpt, tmp_path):
    with pytest.raises(ValueError, match="not LLaVA"):
        _configure(_variant(ckpt, tmp_path, config={"model_type": "qwen2_vl"}))
    with pytest.raises(ValueError, match="model.path"):
        llava.configure(Config())


def test_create_model_refuses_a_foreign_image_token(cfg, tok):
    ids = _ids(cfg, tok) | {"image_token_id": tok.convert_tokens_to_ids(S.IMAGE_PAD)}
    with pytest.raises(ValueError, match="image_token_id"):
        llava.create_model(cfg, ids)


def test_create_model_refuses_a_tokenizer_bigger_than_the_embeddings(cfg, tok):
    with pytest.raises(ValueError, match="model embeds"):
        llava.create_model(cfg, _ids(cfg, tok) | {"vocab_size": len(tok) + 7})


def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    from transformers import AutoModelForImageTextToText

    out = llava.export(model, cfg, tmp_path / "hf")
    sample = built[0][1]
    batch = _collate("pack", [sample], 0)
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    kwargs = model.forward_inputs(batch)
    with torch.no_grad():
        a = model.hf_model(**kwargs).logits
        b = back(**kwargs).logits
    assert (a - b).abs().max().item() < 1e-5
    again = _configure(out)
    assert (again.image.resize, again.image.image_size, again.text.image_token) == ("fixed", SIDE, "<image>")


def test_registry_finds_the_backend(ckpt):
    from ray_mmbatch.config import ModelConfig
    from ray_mmbatch.models import backend_name

    assert backend_name(ModelConfig(path=str(ckpt))) == "llava"
