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
(resize='split', the checkpoints' default), idefics3 without (resize='global').
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
from ray_mmbatch.data.image import ImageSkip, decode_image, image_grid, probe_image
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.measure import measure_batch
from ray_mmbatch.data.text.encoder import tokenizer_for
from ray_mmbatch.models import idefics3
from ray_mmbatch.train.step import batch_to_torch
from tests.hf_idefics3_checkpoint import make_idefics3_checkpoint

SIDE, PS, TILES = 48, 8, 4
N = (SIDE // PS) ** 2 // 4  # LM tokens per view (pixel shuffle 2)
TOL = 1e-4

# (user turn with <image> slots, answer, image sizes (w, h)): no image, a wide one, a thin one with a square
# one, a 1x1 one (blown up to the whole view)
SPECS = [
    ("What is two plus two?", "Four.", []),
    ("<image>\nDescribe the picture in a few words please.", "A noisy strip with a bright stripe.", [(170, 45)]),
    ("<image>\n<image>\nCompare these two images.", "The first is a thin line, the second a square.",
     [(3, 500), (48, 48)]),
    ("<image>\nColour?", "One grey pixel, blown up to a whole view.", [(1, 1)]),
]


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[h // 3: h // 3 + 2, :, 0] = 255  # a stripe, so resize offsets matter
    return Image.fromarray(a)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module", params=[("smolvlm", True), ("idefics3", False)],
                ids=["smolvlm-split", "idefics3-global"])
def ckpt(request, tmp_path_factory):
    model_type, splitting = request.param
    return make_idefics3_checkpoint(tmp_path_factory.mktemp(model_type), model_type, side=SIDE, tiles=TILES,
                                    splitting=splitting)


def _splitting(ckpt) -> bool:
    return bool(json.loads((ckpt / "preprocessor_config.json").read_text())["do_image_splitting"])


@pytest.fixture(scope="module")
def cfg(ckpt):
    c = Config()
    c.model.path = str(ckpt)
    return idefics3.configure(c)


@pytest.fixture(scope="module")
def tok(cfg):
    return tokenizer_for(cfg.text)


def _ids(cfg, tok) -> dict:
    return {"vocab_size": len(tok), "image_token_id": tok.convert_tokens_to_ids(cfg.text.image_token),
            "pad_id": tok.pad_token_id}


@pytest.fixture(scope="module")
def model(cfg, tok):
    return idefics3.create_model(cfg, _ids(cfg, tok)).eval()


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


def _hf_inputs(tok, processor, user: str, answer: str, pics: list):
    """HF processor's (input_ids, pixel_values, pixel_attention_mask) for one conversation, halves called apart."""
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    content = [{"type": "image"} for _ in pics] + [{"type": "text", "text": user.split("\n")[-1]}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text",
                                                                                         "text": answer}]}]
    text = tok.apply_chat_template(messages, tokenize=False)
    pixels = mask = None
    views = []
    if pics:
        out = processor(pics, return_tensors="pt", return_row_col_info=True)
        pixels, mask = out["pixel_values"], out["pixel_attention_mask"]
        grid = list(zip(out["rows"][0], out["cols"][0]))
        views = [r * c + 1 if r else 1 for r, c in grid]
        parts = text.split("<image>")
        assert len(parts) == len(pics) + 1
        text = parts[0] + "".join(get_image_prompt_string(r, c, N, "<fake_token_around_image>", "<image>",
                                                          "<global-img>") + p for (r, c), p in zip(grid, parts[1:]))
    return tok(text).input_ids, pixels, mask, views


def _reference_ce(model, ids: list[int], pixels, mask, labels: np.ndarray) -> torch.Tensor:
    """HF's standard path for ONE sample: full logits, shifted CE at the target positions."""
    ids_t = torch.tensor(ids)[None]
    logits = model.hf_model(input_ids=ids_t, pixel_values=pixels, pixel_attention_mask=mask,
                            attention_mask=torch.ones_like(ids_t)).logits[0]
    labels = torch.as_tensor(labels, dtype=torch.long)
    at = torch.nonzero(labels != S.IGNORE_INDEX).flatten()
    assert torch.equal(labels[at], ids_t[0, at + 1])  # labels are the next tokens: the test's shift is HF's
    return F.cross_entropy(logits[at].float(), ids_t[0, at + 1], reduction="none")


@pytest.fixture(scope="module")
def built(cfg, tok, processor):
    """Samples through the pipeline's data path, with each one's HF processor inputs."""
    pics = [[_image(w, h, 10 * i + j) for j, (w, h) in enumerate(sizes)] for i, (_, _, sizes) in enumerate(SPECS)]
    convs = [[{"from": "human", "value": u}, {"from": "gpt", "value": a}] for u, a, _ in SPECS]
    raw = {S.SAMPLE_ID: [f"s{i}" for i in range(len(SPECS))], S.CONVERSATIONS: [json.dumps(c) for c in convs],
           S.IMAGES: [[_png(p) for p in ps] for ps in pics], S.IMAGE_REFS: [[""] * len(ps) for ps in pics],
           S.READ_ERROR: [""] * len(SPECS)}
    measured = measure_batch(raw, cfg.image, tok, cfg.text)
    assert not any(measured[S.SKIP_REASON]), list(measured[S.SKIP_REASON])
    samples = [materialize_sample({c: measured[c][i] for c in measured}, cfg.image) for i in range(len(SPECS))]
    decoded = [[Image.open(io.BytesIO(b)) for b in raw[S.IMAGES][i]] for i in range(len(SPECS))]
    hf = [_hf_inputs(tok, processor, u, a, d) for (u, a, _), d in zip(SPECS, decoded)]
    return samples, hf, measured


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.fixture(scope="module")
def reference(model, built):
    """Per-target CE of every sample alone (concatenated in sample order) and the gradient of their sum."""
    samples, hf, _ = built
    model.zero_grad(set_to_none=True)
    ces = []
    for s, (ids, pixels, mask, _) in zip(samples, hf):
        ce = _reference_ce(model, ids, pixels, mask, s["labels"])
        ce.sum().backward()
        ces.append(ce.detach())
    return torch.cat(ces), _grads(model)


def _collate(mode: str, samples: list[dict], pad_id: int) -> dict:
    return batch_to_torch((collate_pack if mode == "pack" else collate_pad)(samples, pad_id), "cpu")


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(built, cfg, tok, ckpt):
    samples, hf, measured = built
    image_id = tok.convert_tokens_to_ids("<image>")
    assert cfg.image.resize == ("split" if _splitting(ckpt) else "global")
    all_views = []
    for s, (ids, pixels, mask, views) in zip(samples, hf):
        assert s["input_ids"].tolist() == ids  # the processor's blocks (rows of views, global view), template around
        assert s["grids"].tolist() == [[1, v * SIDE // PS, SIDE // PS] for v in views]
        assert int((s["input_ids"] == image_id).sum()) == sum(views) * N
        all_views += views
        if pixels is None:
            assert len(s["patches"]) == 0
            continue
        assert bool(mask.all())  # no view is padded inside
        from ray_mmbatch.models.internvl import pixel_values

        ours = pixel_values(torch.as_tensor(s["patches"]), s["grids"], SIDE, PS, 2, cfg.image.image_mean,
                            cfg.image.image_std)
        assert ours[None].shape == pixels.shape
        assert (ours[None] - pixels).abs().max().item() < 1e-5
    assert list(measured[S.TOKENS]) == [len(h[0]) for h in hf]
    assert [len(sizes) for *_, sizes in SPECS] == list(measured[S.N_IMAGES])
    assert max(all_views) == (TILES * TILES + 1 if _splitting(ckpt) else 1)  # the 1x1 image: the full grid


@pytest.mark.parametrize("size", [(1, 1), (1, 2), (3, 3), (2, 3), (3, 500), (500, 3), (57, 113), (1000, 10),
                                  (7, 1399), (333, 111), (1, 199), (5000, 40), (49, 48), (96, 95), (145, 97)])
@pytest.mark.parametrize("tiles,splitting", [(1, True), (3, True), (4, False)])
@pytest.mark.parametrize("model_type", ["smolvlm", "idefics3"])
def test_views_equal_hf_for_thin_and_extreme_aspect_images(size, tiles, splitting, model_type):
    """Header-only grid and decoded views vs the PIL SmolVLM / Idefics3 processor (uint8, exact), every resize."""
    from ray_mmbatch.data.image import split_grid

    w, h = size
    processor = _pil_class(model_type)(size={"longest_edge": tiles * SIDE}, max_image_size={"longest_edge": SIDE},
                                       do_image_splitting=splitting, resample=1)
    icfg = ImageConfig(resize="split" if splitting else "global", image_size=SIDE, patch_size=PS, merge_size=2,
                       max_tiles=tiles)
    data = _png(_image(w, h, w * 31 + h))
    hw = probe_image(data, icfg)
    grid = image_grid(*hw, icfg)
    hf = processor(Image.open(io.BytesIO(data)), do_rescale=False, do_normalize=False, return_tensors="np",
                   return_row_col_info=True)
    rows, cols = hf["rows"][0][0], hf["cols"][0][0]
    if splitting:
        assert split_grid(*hw, icfg) == (rows, cols)
    assert tuple(grid) == (1, (rows * cols + 1 if rows else 1) * SIDE // PS, SIDE // PS)
    ours = decode_image(data, grid, icfg).reshape(-1, SIDE, SIDE, 3).transpose(0, 3, 1, 2)[None]
    np.testing.assert_array_equal(ours, hf["pixel_values"].astype(np.uint8))


def test_beyond_max_aspect_is_skipped_with_a_reason():
    """HF resizes a 1 x 300 image; we skip it (extreme_aspect), as every resize mode does beyond max_aspect."""
    icfg = ImageConfig(resize="global", image_size=SIDE, patch_size=PS, merge_size=2, max_tiles=TILES)
    with pytest.raises(ImageSkip) as e:
        image_grid(*probe_image(_png(_image(1, 300, 0)), icfg), icfg)
    assert e.value.reason == S.SKIP_EXTREME_ASPECT


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_batch_equals_each_sample_alone(model, built, reference, tok, mode):
    samples = built[0]
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
    floor = 1e-3 * torch.sqrt(sum(g.norm() ** 2 for g in ref_grads.values()))  # see test_models_llava
    rel = {n: ((grads[n] - g).norm() / torch.maximum(g.norm(), floor)).item() for n, g in ref_grads.items()}
    worst = max(rel.values())
    print(f"{mode}: worst per-parameter relative gradient diff {worst:.2e}")
    assert worst < TOL


@pytest.mark.parametrize("naive", ["positions_not_restarting", "all_ones_mask", "images_in_reverse_order"])
def test_naive_packing_is_caught(model, built, reference, tok, naive):
    """The tolerance is meaningful: a naive packed row, or images given to the wrong samples, move the CE far."""
    batch = _collate("pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    t = batch["input_ids"].shape[1]
    if naive == "positions_not_restarting":
        kwargs["position_ids"] = torch.arange(t)[None]
    elif naive == "all_ones_mask":
        kwargs["attention_mask"] = torch.ones(1, t, dtype=torch.bool)
    else:
        kwargs["pixel_values"] = kwargs["pixel_values"].flip(1)
    with torch.no_grad():
        hidden = model.hf_model.model(**kwargs).last_hidden_state
        ce = model._target_ce(hidden, batch["labels"], "none")
    diff = (ce - reference[0]).abs().max().item()
    print(f"naive {naive}: max per-token CE diff {diff:.2e}")
    assert diff > 100 * TOL, f"{naive}: CE moved only {diff:.2e}, so the exactness test could not fail"


def test_text_only_batch_and_every_weight_gets_a_gradient(model, built, tok):
    samples = built[0]
    assert len(samples[0]["patches"]) == 0
    text_only = _collate("pack", [samples[0]], tok.pad_token_id)
    assert "pixel_values" not in model.forward_inputs(text_only)
    for batch in (text_only, _collate("pad", samples, tok.pad_token_id)):
        ce_sum, n = model(batch, loss_only=True)
        assert int(n) == int((batch["labels"] != S.IGNORE_INDEX).sum())
        ce_sum.backward()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == set(_grads(model))  # DDP: no trainable weight left out of the graph


def test_varlen_kwargs_for_flash_implementations_only(model, built, tok):
    from types import SimpleNamespace

    from ray_mmbatch.models.hf_common import varlen_kwargs

    batch = _collate("pack", built[0], tok.pad_token_id)
    assert "cu_seq_lens_q" not in model.forward_inputs(batch)  # sdpa: the mask from position ids
    text_config = model.hf_model.model.text_model.config
    saved = text_config._attn_implementation
    try:
        text_config._attn_implementation = "flash_attention_2"  # the adapter reads it per call; no forward here
        kwargs = model.forward_inputs(batch)
    finally:
        text_config._attn_implementation = saved
    assert kwargs["cu_seq_lens_q"].tolist() == batch["cu_seqlens"].tolist()
    assert kwargs["max_length_q"] == kwargs["max_length_k"] == int(batch["max_seqlen"])
    assert varlen_kwargs(_collate("pad", built[0], tok.pad_token_id),
                         SimpleNamespace(_attn_implementation="flash_attention_2")) == {}


RECORDED: list[dict] = []


def _recording_flash_sdpa(module, query, key, value, attention_mask, **kwargs):
    """An attention function named like a flash one: records its kwargs; with cu_seq_lens it runs each
    packed sample alone through sdpa (varlen, as flash does), else plain sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    RECORDED.append({k: kwargs.get(k) for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(k, None)
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    kwargs["is_causal"] = True
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return torch.cat(outs, dim=1), None


def test_varlen_kwargs_reach_the_attention_call(cfg, tok, built, reference, ckpt):
    """On a flash-named implementation the packed row's cu_seq_lens / max_length reach every decoder layer's
    attention call, and running on them alone is exact (the vision tower keeps its own sdpa)."""
    from transformers import AttentionInterface

    if not _splitting(ckpt):
        pytest.skip("the adapter is the same with and without splitting: one checkpoint is enough")
    AttentionInterface.register("idefics3_recording_flash_sdpa", _recording_flash_sdpa)
    m = idefics3.create_model(cfg, _ids(cfg, tok)).eval()
    m.hf_model.model.text_model.config._attn_implementation = "idefics3_recording_flash_sdpa"
    batch = _collate("pack", built[0], tok.pad_token_id)
    RECORDED.clear()
    with torch.no_grad():
        ce = m.target_ce(batch)
    assert len(RECORDED) == 2 and all(r["cu_seq_lens_q"] is not None for r in RECORDED)  # both decoder layers
    for r in RECORDED:
        assert r["cu_seq_lens_q"].dtype == torch.int32 and r["cu_seq_lens_q"].tolist() == batch["cu_seqlens"].tolist()
        assert r["max_length_q"] == r["max_length_k"] == int(batch["seq_lens"].max())
    diff = (ce - reference[0]).abs().max().item()
    print(f"pack through the recorded varlen kwargs: max per-token CE diff {diff:.2e}")
    assert diff < TOL


# ------------------------------------------------------------------ configure
def _variant(ckpt, tmp_path, config: dict | None = None, pre: dict | None = None, vision: dict | None = None):
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
    if vision:
        data = json.loads((d / "config.json").read_text())
        data["vision_config"].update(vision)
        (d / "config.json").write_text(json.dumps(data))
    return d


def _configure(path, **overrides):
    from ray_mmbatch.config import apply_overrides

    c = Config()
    c.model.path = str(path)
    return idefics3.configure(apply_overrides(c, overrides))


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    mode = "split" if _splitting(ckpt) else "global"
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.max_tiles) == (mode, SIDE, PS, 2, TILES)
    assert im.image_mean == pytest.approx((0.5, 0.5, 0.5)) and im.image_std == pytest.approx((0.5, 0.5, 0.5))
    assert (cfg.text.tokenizer, cfg.text.image_token) == (str(ckpt), "<image>")
    assert tuple(cfg.text.image_block) == ("<image>", "<fake_token_around_image><global-img><image>"
                                                      "<fake_token_around_image>")


@pytest.mark.parametrize("key,value", [("image.merge_size", 4), ("image.image_size", 64), ("image.patch_size", 16),
                                       ("image.image_mean", "0.4,0.4,0.4"),
                                       ("text.image_token", "<global-img>"), ("image.resize", "fixed")])
def test_configure_refuses_contradicting_settings(ckpt, key, value):
    with pytest.raises(ValueError, match=rf"{re.escape(key)} = .*contradicts the checkpoint"):
        _configure(ckpt, **{key: value})


def test_splitting_from_the_checkpoint_global_on_request(ckpt, tmp_path):
    split = _variant(ckpt, tmp_path, pre={"do_image_splitting": True})
    assert _configure(split).image.resize == "split"
    c = _configure(split, **{"image.resize": "global"})  # HF's processor with do_image_splitting=False
    assert c.image.resize == "global" and c.image.max_tiles == TILES
    (tmp_path / "plain").mkdir()
    plain = _variant(ckpt, tmp_path / "plain", pre={"do_image_splitting": False})
    with pytest.raises(ValueError, match=r"image.resize = .*split.*contradicts the checkpoint"):
        _configure(plain, **{"image.resize": "split"})


def test_max_tiles_is_the_users_to_lower_and_stays_hf_exact(ckpt):
    """image.max_tiles = HF's processor called with size={'longest_edge': max_tiles * S}: fewer views."""
    c = _configure(ckpt, **{"image.max_tiles": 2})
    assert c.image.max_tiles == 2
    data = _png(_image(170, 45, 3))
    hw = probe_image(data, c.image)
    grid = image_grid(*hw, c.image)
    hf = _pil_processor(ckpt)(Image.open(io.BytesIO(data)), size={"longest_edge": 2 * SIDE}, do_rescale=False,
                              do_normalize=False, return_tensors="np")
    ours = decode_image(data, grid, c.image).reshape(-1, SIDE, SIDE, 3).transpose(0, 3, 1, 2)[None]
    np.testing.assert_array_equal(ours, hf["pixel_values"].astype(np.uint8))


def test_splitting_needs_the_row_col_tokens_of_its_grid(ckpt, tmp_path):
    """7 x 7 views need <row_7_col_1>...: the tokenizer has them up to 6 (as the real ones), so refused."""
    with pytest.raises(ValueError, match=r"no tokens \['<row_1_col_7>'"):
        _configure(_variant(ckpt, tmp_path, pre={"do_image_splitting": True, "size": {"longest_edge": 7 * SIDE}}))


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
    with pytest.raises(ValueError, match=match):
        _configure(_variant(ckpt, tmp_path, config=config, pre=pre, vision=vision))


def test_configure_refuses_a_processor_token_count_that_is_not_the_view(ckpt, tmp_path):
    d = _variant(ckpt, tmp_path)
    (d / "processor_config.json").write_text(json.dumps({"image_seq_len": N + 1}))
    with pytest.raises(ValueError, match=f"image_seq_len {N + 1}"):
        _configure(d)
    with pytest.raises(ValueError, match="model.path"):
        idefics3.configure(Config())


def test_export_round_trip_and_registry(model, cfg, built, tmp_path, ckpt):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    from transformers import AutoModelForImageTextToText

    from ray_mmbatch.config import ModelConfig
    from ray_mmbatch.models import backend_name, backend_of

    out = idefics3.export(model, cfg, tmp_path / "hf")
    batch = _collate("pack", [built[0][1]], 0)
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    kwargs = model.forward_inputs(batch)
    with torch.no_grad():
        assert (model.hf_model(**kwargs).logits - back(**kwargs).logits).abs().max().item() < 1e-5
    again = _configure(out)
    assert (again.image.resize, again.image.max_tiles, again.text.image_block) == \
        (cfg.image.resize, TILES, cfg.text.image_block)
    assert backend_name(ModelConfig(path=str(ckpt))) == "idefics3"
    assert backend_of(model) is idefics3
    assert [type(u).__name__ for u in idefics3.fsdp_units(model)] == ["LlamaDecoderLayer"] * 2
    assert idefics3.state_prefix(model) == "hf_model."


def test_verify_packing_job_through_the_data_path(ckpt, tmp_path_factory, capsys):
    """jobs/verify_packing.py on generated data (its image sizes and conversations): exact, and real packs
    (pack mode with splitting, pad mode without: both modes are exact for both above)."""
    import jobs.verify_packing as job
    from ray_mmbatch.synthetic.generate import generate_dataset

    mode = "pack" if _splitting(ckpt) else "pad"

    data = tmp_path_factory.getbasetemp() / "idefics3_verify_data"
    if not data.exists():
        generate_dataset(str(data), 24, "parquet", seed=5, shard_size=24)
    rc = job.main(["--model", str(ckpt), "--data", str(data), "--mode", mode, "--max-tokens", "1024",
                   "--batches", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["ok"] and report["batches"] == 2 and report["max_abs_diff"] < TOL
    if mode == "pack":
        assert report["samples"] > 2
