"""InternVL backend: configure() from a checkpoint, pixels / ids as HF's, packed and padded batches exact.

The reference is HF's own path, one sample at a time: the chat template's render with every
``<IMG_CONTEXT>`` replaced as ``InternVLProcessor.replace_image_token`` replaces it, tokenized by
the checkpoint's tokenizer, ``pixel_values`` from the checkpoint's PIL GotOcr2 image processor
with ``crop_to_patches=True`` (what InternVLProcessor passes; the processor itself needs
torchvision in transformers 5.25, so its two halves are called separately), fed to
``InternVLForConditionalGeneration(input_ids, pixel_values, attention_mask=ones)`` -> logits ->
shifted CE. Our side is the pipeline's: raw rows -> measure_batch -> materialize_sample ->
collate_pack / collate_pad -> HFModel.target_ce. A tiny random checkpoint with
initializer_range 0.2 makes a wrong mask, wrong positions or tiles given to the wrong sample
move the loss by far more than the tolerance (the controls below).
"""
from __future__ import annotations

import io
import json
import re
import shutil
from types import SimpleNamespace

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
from ray_mmbatch.models import internvl
from ray_mmbatch.train.step import batch_to_torch
from tests.hf_internvl_checkpoint import make_internvl_checkpoint

TILE, PS, MAX_TILES = 56, 14, 6
N = (TILE // PS) ** 2 // 4  # LM tokens per tile (pixel shuffle 0.5)
TOL = 1e-4

# (user turn with <image> slots, answer, image sizes (w, h)): no image, one wide (2x... tiles + thumbnail),
# a thin one (max tiles + thumbnail) with a square one (1 tile), a 1x1 one (1 tile)
SPECS = [
    ("What is two plus two?", "Four.", []),
    ("<image>\nDescribe the picture in a few words please.", "A noisy strip with a bright stripe.", [(170, 45)]),
    ("<image>\n<image>\nCompare these two images.", "The first is a thin line, the second a square.",
     [(3, 500), (56, 56)]),
    ("<image>\nColour?", "One grey pixel, blown up to a whole tile.", [(1, 1)]),
]


def _image(w: int, h: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    a[h // 3: h // 3 + 2, :, 0] = 255  # a stripe, so resize offsets and tile order matter
    return Image.fromarray(a)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_internvl_checkpoint(tmp_path_factory.mktemp("internvl"), tile=TILE, max_patches=MAX_TILES)


@pytest.fixture(scope="module")
def cfg(ckpt):
    c = Config()
    c.model.path = str(ckpt)
    return internvl.configure(c)


@pytest.fixture(scope="module")
def tok(cfg):
    return tokenizer_for(cfg.text)


def _ids(cfg, tok) -> dict:
    return {"vocab_size": len(tok), "image_token_id": tok.convert_tokens_to_ids(cfg.text.image_token),
            "pad_id": tok.pad_token_id}


@pytest.fixture(scope="module")
def model(cfg, tok):
    return internvl.create_model(cfg, _ids(cfg, tok)).eval()


@pytest.fixture(scope="module")
def processor(ckpt):
    from transformers import GotOcr2ImageProcessorPil

    return GotOcr2ImageProcessorPil.from_pretrained(str(ckpt))


def _hf_inputs(tok, processor, user: str, answer: str, pics: list) -> tuple[list[int], torch.Tensor | None]:
    """HF InternVL processor's (input_ids, pixel_values) for one conversation, its two halves called apart."""
    from transformers import InternVLProcessor

    content = [{"type": "image"} for _ in pics] + [{"type": "text", "text": user.split("\n")[-1]}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": [{"type": "text",
                                                                                         "text": answer}]}]
    text = tok.apply_chat_template(messages, tokenize=False)
    pixels = None
    if pics:
        out = processor(pics, crop_to_patches=True, return_tensors="pt")  # InternVLProcessor's images_kwargs
        pixels, inputs = out["pixel_values"], {"num_patches": out["num_patches"].tolist()}
        proc = SimpleNamespace(start_image_token=tok.start_image_token, end_image_token=tok.end_image_token,
                               image_token=tok.context_image_token, image_seq_length=N)
        parts = text.split(tok.context_image_token)
        assert len(parts) == len(pics) + 1
        text = parts[0] + "".join(InternVLProcessor.replace_image_token(proc, inputs, i) + p
                                  for i, p in enumerate(parts[1:]))
    return tok(text).input_ids, pixels


def _reference_ce(model, ids: list[int], pixels, labels: np.ndarray) -> torch.Tensor:
    """HF's standard path for ONE sample: full logits, shifted CE at the target positions."""
    ids_t = torch.tensor(ids)[None]
    logits = model.hf_model(input_ids=ids_t, pixel_values=pixels, attention_mask=torch.ones_like(ids_t)).logits[0]
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


@pytest.fixture(scope="module")
def reference(model, built):
    """Per-target CE of every sample alone (concatenated in sample order) and the gradient of their sum."""
    samples, hf, _ = built
    model.zero_grad(set_to_none=True)
    ces = []
    for s, (ids, pixels) in zip(samples, hf):
        ce = _reference_ce(model, ids, pixels, s["labels"])
        ce.sum().backward()
        ces.append(ce.detach())
    return torch.cat(ces), _grads(model)


def _collate(mode: str, samples: list[dict], pad_id: int) -> dict:
    return batch_to_torch((collate_pack if mode == "pack" else collate_pad)(samples, pad_id), "cpu")


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


# ------------------------------------------------------------------ the data path is HF's processor
def test_ids_pixels_and_costs_equal_the_hf_processor(built, cfg, processor, tok):
    samples, hf, measured = built
    for s, (ids, pixels), (_, _, sizes) in zip(samples, hf, SPECS):
        assert s["input_ids"].tolist() == ids  # <img> <IMG_CONTEXT> * tiles * N </img>, template text around
        tiles = [processor.get_number_of_image_patches(h, w, {"crop_to_patches": True}) for w, h in sizes]
        assert s["grids"].tolist() == [[1, t * TILE // PS, TILE // PS] for t in tiles]
        assert int((s["input_ids"] == tok.convert_tokens_to_ids("<IMG_CONTEXT>")).sum()) == sum(tiles) * N
        if pixels is None:
            assert len(s["patches"]) == 0
            continue
        ours = internvl.pixel_values(torch.as_tensor(s["patches"]), s["grids"], TILE, PS, 2, cfg.image.image_mean,
                                     cfg.image.image_std)
        assert ours.shape == pixels.shape
        assert (ours - pixels).abs().max().item() < 1e-5
    assert list(measured[S.TOKENS]) == [len(ids) for ids, _ in hf]
    assert [len(sizes) for *_, sizes in SPECS] == list(measured[S.N_IMAGES])


@pytest.mark.parametrize("size", [(1, 2), (2, 1), (3, 3), (2, 3), (4, 3), (3, 500), (500, 3), (57, 113),
                                  (200, 199), (1000, 10), (7, 1399), (333, 111), (600, 600), (1, 199)])
@pytest.mark.parametrize("max_tiles", [1, 6, 12])
def test_tiles_equal_hf_for_thin_and_extreme_aspect_images(processor, size, max_tiles):
    """Header-only tile count and decoded tiles vs the PIL GotOcr2 processor with crop_to_patches (uint8, exact)."""
    w, h = size
    icfg = ImageConfig(resize="tiles", image_size=TILE, patch_size=PS, merge_size=2, max_tiles=max_tiles)
    data = _png(_image(w, h, w * 31 + h))
    grid = image_grid(*probe_image(data, icfg), icfg)
    hf = processor(Image.open(io.BytesIO(data)), crop_to_patches=True, max_patches=max_tiles, do_rescale=False,
                   do_normalize=False, return_tensors="np")
    assert grid[1] // (TILE // PS) == int(hf["num_patches"][0])
    ours = decode_image(data, grid, icfg).reshape(-1, TILE, TILE, 3).transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(ours, hf["pixel_values"].astype(np.uint8))


def test_beyond_max_aspect_is_skipped_with_a_reason():
    """HF tiles a 1 x 300 image; we skip it (extreme_aspect), as every resize mode does beyond max_aspect."""
    icfg = ImageConfig(resize="tiles", image_size=TILE, patch_size=PS, merge_size=2, max_tiles=MAX_TILES)
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


def _tiles_in_reverse_sample_order(batch: dict) -> torch.Tensor:
    """The batch's pixel_values with each sample's block of tiles kept but the samples' order reversed: the
    tile count per sample ignored, as a sampler that slices the flat tile list by sample gets it wrong."""
    tiles = internvl.tiles_per_image(batch["image_grid_thw"], TILE, PS)
    per_sample = torch.zeros(len(batch["sample_ids"]), dtype=torch.long).index_add_(
        0, batch["image_sample_index"].long(), tiles.long())
    blocks = list(torch.split(torch.arange(int(tiles.sum())), per_sample.tolist()))
    return torch.cat(blocks[::-1])


@pytest.mark.parametrize("naive", ["positions_not_restarting", "all_ones_mask", "tiles_without_sample_boundaries"])
def test_naive_packing_is_caught(model, built, reference, tok, naive):
    """The tolerance is meaningful: a naive packed row, or tiles given to the wrong samples, move the CE far."""
    batch = _collate("pack", built[0], tok.pad_token_id)
    kwargs = model.forward_inputs(batch)
    t = batch["input_ids"].shape[1]
    if naive == "positions_not_restarting":
        kwargs["position_ids"] = torch.arange(t)[None]
    elif naive == "all_ones_mask":
        kwargs["attention_mask"] = torch.ones(1, t, dtype=torch.bool)
    else:
        kwargs["pixel_values"] = kwargs["pixel_values"][_tiles_in_reverse_sample_order(batch)]
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


# ------------------------------------------------------------------ explicit varlen metadata (flash attention)
RECORDED: list[dict] = []


def _recording_flash_sdpa(module, query, key, value, attention_mask, **kwargs):
    """An attention function named like a flash one: records its kwargs; with cu_seq_lens it runs each
    packed sample alone through sdpa (varlen, as flash does), else plain sdpa (the vision tower)."""
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


@pytest.fixture(scope="module")
def flash_named_model(cfg, tok):
    """The model with its language model on the recording function. Set after loading: a name with "flash"
    in it makes from_pretrained look for a flash kernel; the mask builder skips unknown implementations."""
    from transformers import AttentionInterface

    AttentionInterface.register("recording_flash_sdpa", _recording_flash_sdpa)
    m = internvl.create_model(cfg, _ids(cfg, tok)).eval()
    m.hf_model.model.language_model.config._attn_implementation = "recording_flash_sdpa"
    return m


def test_varlen_kwargs_reach_the_attention_call(flash_named_model, built, reference, tok):
    batch = _collate("pack", built[0], tok.pad_token_id)
    RECORDED.clear()
    with torch.no_grad():
        ce = flash_named_model.target_ce(batch)
    lm_calls = [r for r in RECORDED if r["cu_seq_lens_q"] is not None]
    assert len(lm_calls) == len(RECORDED) == 2  # both decoder layers (InternViT stays on sdpa: its own config)
    for r in lm_calls:
        assert r["cu_seq_lens_q"].dtype == torch.int32 and r["cu_seq_lens_q"].tolist() == batch["cu_seqlens"].tolist()
        assert r["cu_seq_lens_k"] is r["cu_seq_lens_q"]
        assert r["max_length_q"] == r["max_length_k"] == int(batch["seq_lens"].max()) and isinstance(
            r["max_length_q"], int)
    diff = (ce - reference[0]).abs().max().item()
    print(f"pack through the recorded varlen kwargs: max per-token CE diff {diff:.2e}")
    assert diff < TOL
    # control: without the kwargs this implementation gets no mask and attends across samples
    kwargs = flash_named_model.forward_inputs(batch)
    for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
        kwargs.pop(k)
    with torch.no_grad():
        hidden = flash_named_model.hf_model.model(**kwargs).last_hidden_state
        naive = flash_named_model._target_ce(hidden, batch["labels"], "none")
    assert (naive - reference[0]).abs().max().item() > 100 * TOL
    pad = flash_named_model.forward_inputs(_collate("pad", built[0], tok.pad_token_id))
    assert "cu_seq_lens_q" not in pad  # padded rows: the 2-D mask says it all


def test_varlen_kwargs_only_for_flash_implementations(model, built, tok):
    from ray_mmbatch.models.hf_common import varlen_kwargs

    batch = _collate("pack", built[0], tok.pad_token_id)
    assert "cu_seq_lens_q" not in model.forward_inputs(batch)  # sdpa: the mask from position ids
    fa = SimpleNamespace(_attn_implementation="flash_attention_2")
    out = varlen_kwargs(batch, fa)
    assert out["cu_seq_lens_q"].tolist() == batch["cu_seqlens"].tolist() and out["max_length_k"] == batch["max_seqlen"]
    assert varlen_kwargs(_collate("pad", built[0], tok.pad_token_id), fa) == {}


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
    return internvl.configure(apply_overrides(c, overrides))


def test_configure_takes_the_checkpoint_settings(cfg, ckpt):
    im = cfg.image
    assert (im.resize, im.image_size, im.patch_size, im.merge_size, im.min_tiles, im.max_tiles) == \
        ("tiles", TILE, PS, 2, 1, MAX_TILES)
    assert im.image_mean == pytest.approx((0.485, 0.456, 0.406))
    assert im.image_std == pytest.approx((0.229, 0.224, 0.225))
    assert (cfg.text.tokenizer, cfg.text.image_token) == (str(ckpt), "<IMG_CONTEXT>")
    assert tuple(cfg.text.image_block) == ("<IMG_CONTEXT>", "<img><IMG_CONTEXT></img>")
    fewer = _configure(ckpt, **{"image.max_tiles": 2})  # the tile bound is the user's to choose
    assert fewer.image.max_tiles == 2
    assert _configure(ckpt, **{"image.image_size": TILE, "text.image_token": "<IMG_CONTEXT>"}).image.resize == "tiles"


@pytest.mark.parametrize("key,value", [("image.merge_size", 4), ("image.image_size", 448), ("image.patch_size", 16),
                                       ("image.image_mean", "0.5,0.5,0.5"), ("text.image_token", "<img>"),
                                       ("image.resize", "fixed")])
def test_configure_refuses_contradicting_settings(ckpt, key, value):
    with pytest.raises(ValueError, match=rf"{re.escape(key)} = .*contradicts the checkpoint"):
        _configure(ckpt, **{key: value})


@pytest.mark.parametrize("config,pre,vision,match", [
    ({"vision_feature_select_strategy": "full"}, None, None, "vision_feature_select_strategy='full'"),
    ({"vision_feature_layer": -2}, None, None, "vision_feature_layer=-2"),
    (None, {"size": {"height": 28, "width": 28}}, None, "vision tower takes 56"),
    (None, {"size": {"height": 56, "width": 28}}, None, "not a square tile size"),
    (None, {"resample": 2}, None, "bicubic"),
    (None, {"image_processor_type": "CLIPImageProcessor"}, None, "GotOcr2"),
    (None, {"min_patches": 7}, None, "min_patches 7"),
    ({"image_seq_length": 256}, None, None, None),  # config.json's is not the processor's: processor_config.json wins
    (None, None, {"patch_size": [16, 16]}, "not a whole number"),
])
def test_configure_refuses_what_the_data_path_cannot_reproduce(ckpt, tmp_path, config, pre, vision, match):
    if match is None:
        assert _configure(_variant(ckpt, tmp_path, config=config)).image.resize == "tiles"
        return
    with pytest.raises(ValueError, match=match):
        _configure(_variant(ckpt, tmp_path, config=config, pre=pre, vision=vision))


def test_configure_refuses_a_processor_token_count_that_is_not_the_tiles(ckpt, tmp_path):
    d = _variant(ckpt, tmp_path)
    (d / "processor_config.json").write_text(json.dumps({"image_seq_length": N + 1}))
    with pytest.raises(ValueError, match=f"image_seq_length {N + 1}"):
        _configure(d)


def test_configure_refuses_other_model_types_and_no_path(ckpt, tmp_path):
    with pytest.raises(ValueError, match="not InternVL"):
        _configure(_variant(ckpt, tmp_path, config={"model_type": "llava"}))
    with pytest.raises(ValueError, match="model.path"):
        internvl.configure(Config())


def test_create_model_refuses_a_foreign_image_token(cfg, tok):
    with pytest.raises(ValueError, match="image_token_id"):
        internvl.create_model(cfg, _ids(cfg, tok) | {"image_token_id": tok.convert_tokens_to_ids("<img>")})


def test_export_round_trip(model, cfg, built, tmp_path):
    """export -> an HF checkpoint that loads, computes the same logits and configures the same way."""
    from transformers import AutoModelForImageTextToText

    out = internvl.export(model, cfg, tmp_path / "hf")
    batch = _collate("pack", [built[0][1]], 0)
    back = AutoModelForImageTextToText.from_pretrained(str(out), dtype=torch.float32).eval()
    kwargs = model.forward_inputs(batch)
    with torch.no_grad():
        assert (model.hf_model(**kwargs).logits - back(**kwargs).logits).abs().max().item() < 1e-5
    again = _configure(out)
    assert (again.image.resize, again.image.max_tiles, again.text.image_block) == \
        ("tiles", MAX_TILES, cfg.text.image_block)


def test_registry_finds_the_backend(ckpt):
    from ray_mmbatch.config import ModelConfig
    from ray_mmbatch.models import backend_name

    assert backend_name(ModelConfig(path=str(ckpt))) == "internvl"



@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_verify_packing_job_through_the_data_path(ckpt, tmp_path_factory, mode, capsys):
    """jobs/verify_packing.py on generated data (its image sizes and conversations): exact, and real packs."""
    import jobs.verify_packing as job
    from ray_mmbatch.synthetic.generate import generate_dataset

    data = tmp_path_factory.getbasetemp() / "internvl_verify_data"
    if not data.exists():
        generate_dataset(str(data), 24, "parquet", seed=5, shard_size=24)
    rc = job.main(["--model", str(ckpt), "--data", str(data), "--mode", mode, "--max-tokens", "1024",
                   "--batches", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["ok"] and report["batches"] == 2 and report["max_abs_diff"] < TOL
    if mode == "pack":
        assert report["samples"] > 2


def test_fsdp_units_are_the_decoder_layers_and_vision_is_apart(model):
    from ray_mmbatch.models import backend_of

    assert backend_of(model) is internvl
    units = internvl.fsdp_units(model)
    assert [type(u).__name__ for u in units] == ["Qwen2DecoderLayer"] * 2
    vision = {id(m) for v in internvl.vision_modules(model) for m in v.modules()}
    assert id(model.hf_model.model.vision_tower.encoder.layer[0]) in vision
    assert internvl.state_prefix(model) == "hf_model."
