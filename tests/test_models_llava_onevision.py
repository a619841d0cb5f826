"""LLaVA-OneVision backend: configure() from a checkpoint, pixels / ids as HF's, packed and padded batches exact.

The reference is HF's own path, one sample at a time: the chat template's render with every ``<image>``
replaced as ``LlavaOnevisionProcessor.replace_image_token`` replaces it (the processor's own method, on an
instance built without its video processor: in transformers 5.25 the processor needs torchvision),
tokenized by the checkpoint's tokenizer; ``pixel_values``, ``image_sizes`` and ``batch_num_images`` from
the checkpoint's PIL image processor given the sample's images as one nested list; fed to
``LlavaOnevisionForConditionalGeneration(input_ids, pixel_values, image_sizes, batch_num_images,
attention_mask=ones)`` -> logits -> shifted CE. Our side is the pipeline's: raw rows -> measure_batch ->
materialize_sample -> collate_pack / collate_pad -> HFModel.target_ce. A tiny random checkpoint with
initializer_range 0.2 makes a wrong mask, wrong positions, or the wrong image_sizes / batch_num_images move
the loss by far more than the tolerance (the controls below).
"""
from __future__ import annotations

import io
import json
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ray_mmbatch import schema as S
from ray_mmbatch.batching.collate import collate_pack, collate_pad
from ray_mmbatch.config import Config
from ray_mmbatch.data.image import ImageSkip, decode_image, image_grid, image_tokens, probe_image
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.measure import measure_batch
from ray_mmbatch.data.text.encoder import tokenizer_for
from ray_mmbatch.models import llava_onevision as ov
from ray_mmbatch.train.step import batch_to_torch
from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

TILE, PS = 42, 14
G = TILE // PS
TOL = 1e-4

# (user turn with <image> slots, answer, image sizes (w, h)): no image; a wide one (anyres, pooled); two in one
# sample (base tiles only: a thin line and a square); a 1x1 one (anyres); a tall one (anyres, unpadded)
SPECS = [
    ("What is two plus two?", "Four.", []),
    ("<image>\nDescribe the picture in a few words please.", "A noisy strip with a bright stripe.", [(170, 45)]),
    ("<image>\n<image>\nCompare these two images.", "The first is a thin line, the second a square.",
     [(3, 100), (42, 42)]),
    ("<image>\nColour?", "One grey pixel.", [(1, 1)]),
    ("<image>\nAnd this one?", "A tall noisy page.", [(61, 150)]),
]


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[h // 3: h // 3 + 2, :, 0] = 255  # a stripe, so resize offsets and crop order matter
    return Image.fromarray(a)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_llava_onevision_checkpoint(tmp_path_factory.mktemp("onevision"), tile=TILE)


@pytest.fixture(scope="module")
def cfg(ckpt):
    c = Config()
    c.model.path = str(ckpt)
    return ov.configure(c)


@pytest.fixture(scope="module")
def tok(cfg):
    return tokenizer_for(cfg.text)


def _ids(cfg, tok) -> dict:
    return {"vocab_size": len(tok), "image_token_id": tok.convert_tokens_to_ids(cfg.text.image_token),
            "pad_id": tok.pad_token_id}


@pytest.fixture(scope="module")
def model(cfg, tok):
    return ov.create_model(cfg, _ids(cfg, tok)).eval()


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import LlavaOnevisionImageProcessorPil

    return LlavaOnevisionImageProcessorPil.from_pretrained(str(ckpt))


def _hf_processor(processor, anyres_max: int = 2):
    """LlavaOnevisionProcessor without its video processor (torchvision): its token-count methods only."""
    from transformers import LlavaOnevisionProcessor

    p = LlavaOnevisionProcessor.__new__(LlavaOnevisionProcessor)
    p.image_processor, p.num_image_tokens, p.image_token = processor, G * G, "<image>"
    p.vision_feature_select_strategy, p.vision_aspect_ratio = "full", f"anyres_max_{anyres_max}"
    return p


def _hf_inputs(tok, processor, user: str, answer: str, pics: list) -> tuple[list[int], dict]:
    """HF LLaVA-OneVision processor's input_ids and image inputs for one conversation."""
    content = [{"type": "image"} for _ in pics] + [{"type": "text", "text": user.split("\n")[-1]}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text",
                                                                                         "text": answer}]}]
    text = tok.apply_chat_template(messages, tokenize=False)
    inputs = {}
    if pics:
        out = processor([pics], return_tensors="pt")  # one sample: batch_num_images = [len(pics)]
        inputs = {k: out[k] for k in ("pixel_values", "image_sizes", "batch_num_images")}
        proc = _hf_processor(processor)
        parts = text.split("<image>")
        assert len(parts) == len(pics) + 1
        text = parts[0] + "".join(proc.replace_image_token(inputs, i) + p for i, p in enumerate(parts[1:]))
    return tok(text).input_ids, inputs


def _reference_ce(model, ids: list[int], inputs: dict, labels: np.ndarray) -> torch.Tensor:
    """HF's standard path for ONE sample: full logits, shifted CE at the target positions."""
    ids_t = torch.tensor(ids)[None]
    logits = model.hf_model(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), **inputs).logits[0]
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
    for s, (ids, inputs) in zip(samples, hf):
        ce = _reference_ce(model, ids, inputs, s["labels"])
        ce.sum().backward()
        ces.append(ce.detach())
    return torch.cat(ces), _grads(model)


def _collate(mode: str, samples: list[dict], pad_id: int) -> dict:
    return batch_to_torch((collate_pack if mode == "pack" else collate_pad)(samples, pad_id), "cpu")


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(built, cfg, tok):
    samples, hf, measured = built
    image_id = tok.convert_tokens_to_ids("<image>")
    for s, (ids, inputs), (_, _, sizes) in zip(samples, hf, SPECS):
        assert s["input_ids"].tolist() == ids  # one contiguous run of <image> per image, template text around
        if not sizes:
            assert len(s["patches"]) == 0 and "image_sizes" in s and len(s["image_sizes"]) == 0
            continue
        assert s["image_sizes"].tolist() == inputs["image_sizes"].tolist() == [[h, w] for w, h in sizes]
        want = sum(image_tokens(g, hw, cfg.image) for g, hw in zip(s["grids"], s["image_sizes"]))
        assert int((s["input_ids"] == image_id).sum()) == want
        ours = ov.pixel_values(torch.as_tensor(s["patches"]), TILE, cfg.image.image_mean, cfg.image.image_std)
        theirs = inputs["pixel_values"].flatten(0, 1)
        n_real = [int(g[1]) for g in s["grids"]]  # HF pads every image to the most crops of the call: drop them
        keep = torch.cat([torch.arange(i * inputs["pixel_values"].shape[1], i * inputs["pixel_values"].shape[1] + n)
                          for i, n in enumerate(n_real)])
        assert ours.shape == theirs[keep].shape
        assert (ours - theirs[keep]).abs().max().item() < 1e-5
    assert list(measured[S.TOKENS]) == [len(ids) for ids, _ in hf]


SIZES = [(1, 2), (2, 1), (3, 3), (2, 3), (4, 3), (3, 500), (500, 3), (57, 113), (200, 199), (1000, 10), (7, 1399),
         (333, 111), (600, 600), (1, 199), (43, 41), (85, 42), (170, 45)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("n_images", [1, 2])
def test_tiles_and_tokens_equal_hf_for_thin_and_extreme_aspect_images(cfg, processor, size, n_images):
    """Header-only tile and token counts and decoded tiles vs the PIL processor (uint8, exact) and
    LlavaOnevisionProcessor's token count, for a sample's only image and for one of several."""
    w, h = size
    icfg = cfg.image
    data = _png(_image(w, h, w * 31 + h))
    hw = probe_image(data, icfg)
    grid = image_grid(*hw, icfg, n_images=n_images)
    img = Image.open(io.BytesIO(data))
    other = Image.new("RGB", (5, 5))
    hf = processor([[img] + [other] * (n_images - 1)], do_rescale=False, do_normalize=False, return_tensors="np")
    n = int(grid[1])
    assert n == (1 if n_images > 1 else 1 + int(np.any(hf["pixel_values"][0, 1:] != 0, axis=(1, 2, 3)).sum()) or n)
    ours = decode_image(data, grid, icfg).reshape(-1, TILE, TILE, 3).transpose(0, 3, 1, 2)
    theirs = hf["pixel_values"][0, :n]
    np.testing.assert_array_equal(ours, theirs.astype(np.uint8))
    assert not hf["pixel_values"][0, n:].any()  # HF's batch padding only beyond our tiles
    text = _hf_processor(processor).replace_image_token(
        {k: hf[k] for k in ("image_sizes", "batch_num_images", "pixel_values")}, 0)
    assert image_tokens(grid, hw, icfg) == text.count("<image>")


@pytest.mark.parametrize("anyres_max", [1, 9])
def test_token_count_follows_anyres_max(cfg, processor, anyres_max):
    from dataclasses import replace

    icfg = replace(cfg.image, anyres_max=anyres_max)
    proc = _hf_processor(processor, anyres_max)
    for w, h in SIZES:
        grid = image_grid(h, w, icfg)
        want = proc._get_number_of_features(h, w, TILE, TILE)
        assert image_tokens(grid, (h, w), icfg) == want, (w, h)


def test_beyond_max_aspect_is_skipped_with_a_reason(cfg):
    """HF processes a 1 x 300 image; we skip it (extreme_aspect), as every resize mode does beyond max_aspect."""
    with pytest.raises(ImageSkip) as e:
        image_grid(*probe_image(_png(_image(1, 300, 0)), cfg.image), cfg.image)
    assert e.value.reason == S.SKIP_EXTREME_ASPECT


# ------------------------------------------------------------------ exactness
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_batch_equals_each_sample_alone(model, built, reference, tok, mode):
    samples = built[0]
    ref_ce, ref_grads = reference
    batch = _collate(mode, samples, tok.pad_token_id)
    assert ov.images_per_sample(batch) == [len(sz) for *_, sz in SPECS]
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


@pytest.mark.parametrize("naive", ["positions_not_restarting", "all_ones_mask", "images_per_row"])
def test_naive_packing_is_caught(model, built, reference, tok, naive):
    """The tolerance is meaningful: a naive packed row moves the CE far. 'images_per_row': batch_num_images
    counted per packed row instead of per sample (every image then gets the base tile only)."""
    samples = built[0]
    if naive == "images_per_row":  # the row's images share no tiles: only one-image samples, each anyres
        samples = [s for s in samples if len(s["grids"]) == 1]
    batch = _collate("pack", samples, tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    t = batch["input_ids"].shape[1]
    if naive == "positions_not_restarting":
        kwargs["position_ids"] = torch.arange(t)[None]
    elif naive == "all_ones_mask":
        kwargs["attention_mask"] = torch.ones(1, t, dtype=torch.bool)
    else:
        kwargs["batch_num_images"] = [len(samples)]
    with torch.no_grad():
        try:
            hidden = model.hf_model.model(**kwargs).last_hidden_state
        except (ValueError, RuntimeError) as e:  # HF refuses: tiles or features no longer match the tokens
            print(f"naive {naive}: HF refuses ({e})")
            return
        ce = model._target_ce(hidden, batch["labels"], "none")
    ref = reference[0]
    if naive == "images_per_row":
        ref = torch.cat([c for c, s in zip(torch.split(ref, [int((s["labels"] != S.IGNORE_INDEX).sum())
                                                             for s in built[0]]), built[0])
                         if len(s["grids"]) == 1])
    diff = (ce - ref).abs().max().item()
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


def test_split_batch_keeps_image_sizes(built, tok):
    from ray_mmbatch.batching.layout import split_batch

    samples = built[0]
    for mode in ("pack", "pad"):
        back = split_batch((collate_pack if mode == "pack" else collate_pad)(samples, tok.pad_token_id))
        for a, b in zip(samples, back):
            assert b["image_sizes"].tolist() == a["image_sizes"].tolist()


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
    return ov.configure(apply_overrides(c, overrides))


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.anyres_max, im.anyres_features) == \
        ("anyres", TILE, TILE, 1, 2, G)
    assert len(im.grid_pinpoints) == 32
    assert (cfg.text.tokenizer, cfg.text.image_token, tuple(cfg.text.image_block)) == (str(ckpt), "<image>", ())


@pytest.mark.parametrize("config,pre,vision,match", [
    ({"vision_feature_select_strategy": "default"}, None, None, "vision_feature_select_strategy='default'"),
    ({"vision_feature_layer": -2}, None, None, "vision_feature_layer=-2"),
    ({"vision_aspect_ratio": "anyres"}, None, None, "anyres_max_N"),
    ({"image_grid_pinpoints": [[42, 50]]}, None, None, "multiples"),
    (None, {"size": {"height": 28, "width": 28}}, None, "vision tower takes 42"),
    (None, {"resample": 2}, None, "bicubic"),
    (None, {"image_processor_type": "CLIPImageProcessor"}, None, "LlavaOnevision"),
    (None, {"image_grid_pinpoints": [[42, 42]]}, None, "differ"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, vision, match):
    with pytest.raises(ValueError, match=match):
        _configure(_variant(ckpt, tmp_path, config=config, pre=pre, vision=vision))


def test_configure_refuses_other_model_types_and_no_path(ckpt, tmp_path):
    with pytest.raises(ValueError, match="not LLaVA-OneVision"):
        _configure(_variant(ckpt, tmp_path, config={"model_type": "llava"}))
    with pytest.raises(ValueError, match="model.path"):
        ov.configure(Config())


def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    from transformers import AutoModelForImageTextToText

    out = ov.export(model, cfg, tmp_path / "hf")
    batch = _collate("pack", [built[0][1]], 0)
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    kwargs = model.forward_inputs(batch)
    with torch.no_grad():
        assert (model.hf_model(**kwargs).logits - back(**kwargs).logits).abs().max().item() < 1e-5
    again = _configure(out)
    assert (again.image.resize, again.image.grid_pinpoints) == ("anyres", cfg.image.grid_pinpoints)


def test_registry_finds_the_backend(ckpt):
    from ray_mmbatch.config import ModelConfig
    from ray_mmbatch.models import backend_name

    assert backend_name(ModelConfig(path=str(ckpt))) == "llava_onevision"


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_verify_packing_job_through_the_data_path(ckpt, tmp_path_factory, mode, capsys):
    """jobs/verify_packing.py on generated data (its image sizes and conversations): exact, and real packs."""
    import jobs.verify_packing as job
    from ray_mmbatch.synthetic.generate import generate_dataset

    data = tmp_path_factory.getbasetemp() / "onevision_verify_data"
    if not data.exists():
        generate_dataset(str(data), 24, "parquet", seed=5, shard_size=24)
    rc = job.main(["--model", str(ckpt), "--data", str(data), "--mode", mode, "--max-tokens", "2048",
                   "--batches", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["ok"] and report["batches"] == 2 and report["max_abs_diff"] < TOL
    if mode == "pack":
        assert report["samples"] > 2


def test_fsdp_units_are_the_decoder_layers_and_vision_is_apart(model):
    from ray_mmbatch.models import backend_of

    assert backend_of(model) is ov
    units = ov.fsdp_units(model)
    assert [type(u).__name__ for u in units] == ["Qwen2DecoderLayer"] * 2
    vision = {id(m) for v in ov.vision_modules(model) for m in v.modules()}
    assert id(model.hf_model.model.vision_tower.encoder.layers[0]) in vision


def test_fast_decode_keeps_the_tiles_shape(cfg):
    """fast_decode (not HF's pixels) drafts a JPEG no smaller than the best resolution its crops are cut from."""
    from dataclasses import replace

    fast = replace(cfg.image, fast_decode=True)
    for w, h in [(900, 120), (120, 900), (500, 500)]:
        buf = io.BytesIO()
        _image(w, h, 1).save(buf, format="JPEG", quality=90)
        data = buf.getvalue()
        for n_images in (1, 2):
            grid = image_grid(*probe_image(data, fast), fast, n_images=n_images)
            exact = decode_image(data, grid, cfg.image).astype(int)
            approx = decode_image(data, grid, fast).astype(int)
            assert approx.shape == exact.shape == (int(grid[1]) * TILE, TILE, 3)
            assert np.abs(approx - exact).mean() < 20  # the same picture, resampled differently


# ------------------------------------------------------------------ explicit varlen metadata (flash attention)
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


def test_varlen_kwargs_reach_the_attention_call(cfg, tok, built, reference):
    """On a flash-named implementation the packed row's cu_seq_lens / max_length reach both decoder layers'
    attention call, and the loss is exact on them alone (no mask: without them attention crosses samples)."""
    from transformers import AttentionInterface

    AttentionInterface.register("recording_flash_sdpa", _recording_flash_sdpa)
    m = ov.create_model(cfg, _ids(cfg, tok)).eval()
    m.hf_model.model.language_model.config._attn_implementation = "recording_flash_sdpa"
    batch = _collate("pack", built[0], tok.pad_token_id)
    RECORDED.clear()
    with torch.no_grad():
        ce = m.target_ce(batch)
    assert len(RECORDED) == 2  # both decoder layers (SigLIP stays on sdpa: its own config)
    for r in RECORDED:
        assert r["cu_seq_lens_q"].dtype == torch.int32 and r["cu_seq_lens_q"].tolist() == batch["cu_seqlens"].tolist()
        assert r["cu_seq_lens_k"] is r["cu_seq_lens_q"]
        assert r["max_length_q"] == r["max_length_k"] == int(batch["seq_lens"].max())
    diff = (ce - reference[0]).abs().max().item()
    print(f"pack through the recorded varlen kwargs: max per-token CE diff {diff:.2e}")
    assert diff < TOL
    kwargs = m.forward_inputs(batch)
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k)
    with torch.no_grad():
        naive = m._target_ce(m.hf_model.model(**kwargs).last_hidden_state, batch["labels"], "none")
    assert (naive - reference[0]).abs().max().item() > 100 * TOL
    assert "cu_seq_lens_q" not in m.forward_inputs(_collate("pad", built[0], tok.pad_token_id))
