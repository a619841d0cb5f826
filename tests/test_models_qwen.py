"""Qwen-VL backend: configure() from a checkpoint, and packed / padded batches equal HF's per-sample path.

For each family (Qwen2-VL, Qwen2.5-VL, Qwen3-VL; tiny random checkpoints, tests/hf_checkpoints.py)
samples go through the real data path (RAW rows -> measure -> materialize -> collate -> torch),
and the CE of every target token of the packed (padded) batch must equal running that sample
alone through HF's standard forward (its own positions, the HF image processor's pixels) within
the family's tolerance in fp32 (tests/family_harness.TOLERANCE, one place for every family); the
gradient of the batch's loss sum must equal the sum of the per-sample ones within its gradient
tolerance. initializer_range 0.2 makes a leak or a wrong position cost far more than that, and the
naive feeds (1-D position ids, use_cache=True, no mm_token_type_ids) are shown to be caught.
"""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from skimage import data as skdata

from ray_mmbatch import schema as S
from ray_mmbatch.batching.collate import collate_pack, collate_pad
from ray_mmbatch.config import Config
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.measure import measure_batch
from ray_mmbatch.data.text.tokenizer import SHIPPED_TOKENIZER, load_tokenizer
from ray_mmbatch.models import qwen_vl
from ray_mmbatch.models.hf_common import normalize_patches
from ray_mmbatch.train.step import batch_to_torch
from tests import family_harness as h
from tests.family_harness import TOLERANCE
from tests.hf_checkpoints import QWEN_MODEL_TYPES, make_qwen_checkpoint
from tests.test_measure import columns as _columns

COLLATE = {"pack": collate_pack, "pad": collate_pad}


def encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt)
    return buf.getvalue()


def _images() -> dict[str, bytes]:
    """Real photos, several sizes (one below min_pixels, so upscaled), PNG and JPEG."""
    astronaut, chelsea = Image.fromarray(skdata.astronaut()), Image.fromarray(skdata.chelsea())
    return {"astro_png": encode(astronaut.resize((150, 110)), "PNG"),
            "cat_jpeg": encode(chelsea.resize((130, 200)), "JPEG"),
            "small_png": encode(Image.fromarray(skdata.coffee()).resize((40, 52)), "PNG"),
            "wide_jpeg": encode(astronaut.resize((230, 96)), "JPEG")}


def _raw_rows() -> list[dict]:
    img = _images()
    specs = [  # (id, conversation, images): 0, 1, 2 and 1 images, different lengths
        ("text", [{"from": "human", "value": "Name three prime numbers."},
                  {"from": "gpt", "value": "Two, three and five."},
                  {"from": "human", "value": "And the next one?"}, {"from": "gpt", "value": "Seven."}], []),
        ("one", [{"from": "human", "value": "<image>\nWhat is shown here?"},
                 {"from": "gpt", "value": "An astronaut in a white suit next to a flag."}], [img["astro_png"]]),
        ("two", [{"from": "human", "value": "Compare <image> with <image> please."},
                 {"from": "gpt", "value": "The first is a cat; the second is a cup of coffee."}],
         [img["cat_jpeg"], img["small_png"]]),
        ("wide", [{"from": "human", "value": "<image> Caption?"}, {"from": "gpt", "value": "A wide crop."}],
         [img["wide_jpeg"]]),
    ]
    return [{S.SAMPLE_ID: sid, S.CONVERSATIONS: json.dumps(conv), S.IMAGES: images,
             S.IMAGE_REFS: [f"{sid}/{j}" for j in range(len(images))], S.READ_ERROR: ""}
            for sid, conv, images in specs]




@pytest.fixture(scope="module", params=QWEN_MODEL_TYPES)
def family(request, tmp_path_factory):
    """A checkpoint, its configured Config, the model, and the samples of _raw_rows materialized."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = make_qwen_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    cfg = Config()
    cfg.model.path = str(path)
    qwen_vl.configure(cfg)
    tok = load_tokenizer(cfg.text.tokenizer)
    ids = {"vocab_size": len(tok), "image_token_id": tok.convert_tokens_to_ids(cfg.text.image_token),
           "pad_id": tok.pad_token_id}
    torch.manual_seed(0)
    model = qwen_vl.create_model(cfg, ids).eval()
    raw = _raw_rows()
    measured = measure_batch(_columns(raw), cfg.image, tok, cfg.text)
    rows = [{c: measured[c][i] for c in measured} for i in range(len(raw))]
    assert all(not r[S.SKIP_REASON] for r in rows), [r[S.SKIP_REASON] for r in rows]
    samples = [materialize_sample(r, cfg.image) for r in rows]
    processor = Qwen2VLImageProcessorPil.from_pretrained(path)
    return SimpleNamespace(name=request.param, path=path, cfg=cfg, ids=ids, model=model, raw=raw, samples=samples,
                           processor=processor, tol=TOLERANCE[request.param])


def _hf_pixels(fam, i: int):
    """HF's own image processor on the sample's decoded images: (pixel_values, image_grid_thw) or (None, None)."""
    images = [Image.open(io.BytesIO(b)).convert("RGB") for b in fam.raw[i][S.IMAGES]]
    if not images:
        return None, None
    out = fam.processor(images=images, return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"]


def _reference_ce(fam, i: int, pixels: str = "hf", loss_sum: bool = False):
    """Sample i alone through HF's standard path: per-target-token CE (HF-style shift), or its sum."""
    s = fam.samples[i]
    ids = torch.as_tensor(s["input_ids"], dtype=torch.long)[None]
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if len(s["grids"]):
        if pixels == "hf":
            pixel_values, grid = _hf_pixels(fam, i)
        else:
            pixel_values = normalize_patches(torch.as_tensor(s["patches"]), fam.cfg.image.image_mean,
                                             fam.cfg.image.image_std, fam.cfg.image.temporal_patch_size)
            grid = torch.as_tensor(s["grids"], dtype=torch.long)
        kwargs.update(pixel_values=pixel_values, image_grid_thw=grid,
                      mm_token_type_ids=(ids == fam.ids["image_token_id"]).int())
    # HF's label convention: labels[t] = the token at t where it is a target (unshifted); the
    # model predicts labels[t + 1] from position t. Our labels are already shifted by one.
    shifted = torch.as_tensor(s["labels"], dtype=torch.long)
    hf_labels = torch.full_like(shifted, S.IGNORE_INDEX)
    hf_labels[1:] = shifted[:-1]
    out = fam.model.hf_model(**kwargs, labels=hf_labels[None], use_cache=False)
    logits, targets = out.logits[0, :-1].float(), hf_labels[1:]
    keep = targets != S.IGNORE_INDEX
    ce = F.cross_entropy(logits[keep], targets[keep], reduction="none")
    assert torch.allclose(out.loss, ce.mean(), atol=1e-5)  # HF's own loss agrees with the shift above
    return ce.sum() if loss_sum else ce


def _batch(fam, mode: str, which=None) -> dict:
    samples = [fam.samples[i] for i in (which if which is not None else range(len(fam.samples)))]
    return batch_to_torch(COLLATE[mode](samples, fam.ids["pad_id"]), "cpu")


def _split(ce: torch.Tensor, fam, which) -> list[torch.Tensor]:
    counts = [int((np.asarray(fam.samples[i]["labels"]) != S.IGNORE_INDEX).sum()) for i in which]
    return list(torch.split(ce, counts))


# ------------------------------------------------------------------ pixels and exactness
def test_our_pixels_equal_the_hf_image_processor(family):
    """Grid and pixel_values of the data path == Qwen2VLImageProcessorPil on the same image."""
    for i, s in enumerate(family.samples):
        if not len(s["grids"]):
            continue
        hf_pixels, hf_grid = _hf_pixels(family, i)
        ours = normalize_patches(torch.as_tensor(s["patches"]), family.cfg.image.image_mean,
                                 family.cfg.image.image_std, family.cfg.image.temporal_patch_size)
        assert torch.equal(hf_grid, torch.as_tensor(s["grids"], dtype=torch.long))
        assert ours.shape == hf_pixels.shape
        assert (ours - hf_pixels).abs().max() < 1e-5, f"{s['sample_id']}: pixels differ from HF's processor"


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_batch_equals_each_sample_alone_through_hf(family, mode):
    which = range(len(family.samples))
    batch = _batch(family, mode)
    with torch.no_grad():
        ours = _split(family.model.target_ce(batch), family, which)
        refs = [_reference_ce(family, i) for i in which]
    worst = 0.0
    for _i, (a, b) in enumerate(zip(ours, refs)):
        assert a.shape == b.shape and len(a) > 0
        worst = max(worst, float((a - b).abs().max()))
    print(f"{family.name} {mode}: max per-token |CE diff| = {worst:.2e} (tolerance {family.tol.ce:.0e})")
    assert worst < family.tol.ce


def test_flash_attention_gets_the_varlen_metadata(family):
    """Flash attention gets the packed row's cu_seq_lens / max_length explicitly (not inferred from ids)."""
    from tests.varlen_check import check_varlen

    which = range(len(family.samples))
    batch = _batch(family, "pack")
    with torch.no_grad():
        reference = torch.cat([_reference_ce(family, i) for i in which])
    diff = check_varlen(family.model, family.model.hf_model.model.language_model.config, batch, reference,
                       family.tol.ce)
    print(f"{family.name} pack on recorded varlen kwargs: max per-token |CE diff| = {diff:.2e}")
    assert "cu_seq_lens_q" not in family.model.forward_inputs(_batch(family, "pad"))  # sdpa / pad: none


def test_eager_attention_packs_exactly_too(family):
    """attn_implementation='eager' gets its block mask from the same row-0 positions."""
    cfg = Config()
    cfg.model.path = family.cfg.model.path
    cfg.model.attn_implementation = "eager"
    qwen_vl.configure(cfg)
    eager = SimpleNamespace(**{**vars(family), "model": qwen_vl.create_model(cfg, family.ids).eval()})
    assert eager.model.hf_model.config._attn_implementation == "eager"
    which = range(len(family.samples))
    with torch.no_grad():
        ours = torch.cat(_split(eager.model.target_ce(_batch(eager, "pack")), eager, which))
        refs = torch.cat([_reference_ce(eager, i) for i in which])
    assert float((ours - refs).abs().max()) < family.tol.ce


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_batch_gradients_equal_sum_of_per_sample_gradients(family, mode):
    model = family.model
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    loss, n = model(_batch(family, mode), loss_only=True)
    loss.backward()
    ours = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    for i in range(len(family.samples)):
        _reference_ce(family, i, loss_sum=True).backward()
    refs = [p.grad.clone() for p in params]
    model.zero_grad(set_to_none=True)
    assert int(n) == sum(int((np.asarray(s["labels"]) != S.IGNORE_INDEX).sum()) for s in family.samples)
    worst = max(float((a - b).norm() / (b.norm() + 1e-12)) for a, b in zip(ours, refs) if b.norm() > 0)
    print(f"{family.name} {mode}: max relative gradient diff = {worst:.2e} (tolerance {family.tol.grad:.0e})")
    assert worst < family.tol.grad
    assert all(b.norm() > 0 for b in refs[:3])  # the vision tower's first weights did learn


def test_text_only_batch_keeps_vision_in_the_graph(family):
    batch = _batch(family, "pack", which=[0])
    assert batch["patches"].shape[0] == 0
    kwargs = family.model.forward_inputs(batch)
    assert "pixel_values" not in kwargs and "image_grid_thw" not in kwargs
    family.model.zero_grad(set_to_none=True)
    loss, _ = family.model(batch, loss_only=True)
    loss.backward()
    visual = family.model.hf_model.model.visual
    assert all(p.grad is not None and float(p.grad.abs().sum()) == 0.0 for p in visual.parameters())
    family.model.zero_grad(set_to_none=True)
    with torch.no_grad():
        assert torch.allclose(family.model.target_ce(batch), _reference_ce(family, 0), atol=family.tol.ce, rtol=0)


def test_packed_position_ids_layout(family):
    """Row 0 restarts per sample; rows 1-3 equal HF's own get_rope_index of each sample alone."""
    batch = _batch(family, "pack")
    pos = family.model.forward_inputs(batch)["position_ids"]
    assert pos.shape == (4, 1, batch["input_ids"].shape[1])
    assert torch.equal(pos[0], batch["position_ids"])
    cu = batch["cu_seqlens"].tolist()
    base = family.model.hf_model.model
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        seg = batch["input_ids"][:, a:b]
        if len(family.samples[i]["grids"]):
            want, _ = base.get_rope_index(seg, (seg == family.ids["image_token_id"]).int(),
                                          image_grid_thw=torch.as_tensor(family.samples[i]["grids"]).long())
            assert int(want.max()) < b - a - 1  # the image really compresses the positions
        else:
            want = torch.arange(b - a).expand(3, 1, -1)
        assert torch.equal(pos[1:, :, a:b], want)


# HF's refusal of image inputs without mm_token_type_ids (Qwen2-VL, Qwen3-VL: M-RoPE needs them)
NO_TOKEN_TYPES = (ValueError, r"but `mm_token_type_ids` is missing\. Please pass `mm_token_type_ids`")


def test_naive_feeds_are_caught(family):
    """What the exactness test would see if the adapter fed HF the obvious way (h.check_caught): every target
    token's CE against HF's per-sample path moves by more than 100 x the family's tolerance, or HF refuses the
    feed for what is wrong with it. 1-D position ids: no M-RoPE (Qwen2/2.5-VL: no packing either); use_cache:
    a cache turns packing detection off; a padded batch without mm_token_type_ids: Qwen2-VL and Qwen3-VL refuse
    it (NO_TOKEN_TYPES), Qwen2.5-VL silently falls back to 1-D positions and must move the CE."""
    pack, pad = _batch(family, "pack"), _batch(family, "pad")
    feeds = {"1-D position ids": (pack, lambda kw: kw.update(position_ids=pack["position_ids"])),
             "use_cache=True": (pack, lambda kw: kw.update(use_cache=True)),
             "no mm_token_type_ids": (pad, lambda kw: kw.pop("mm_token_type_ids"))}
    with torch.no_grad():
        reference = torch.cat([_reference_ce(family, i) for i in range(len(family.samples))])
    for naive, (batch, change) in feeds.items():
        kwargs = family.model.forward_inputs(batch)
        change(kwargs)
        refused = naive == "no mm_token_type_ids" and family.name != "qwen2_5_vl"
        moved = h.check_caught(family.model, batch, kwargs, reference, f"{family.name} {naive}", family.tol,
                               may_refuse=(NO_TOKEN_TYPES,) if refused else ())
        assert (moved is None) == refused, naive


def test_gradient_checkpointing_gives_the_same_gradients(family):
    if family.name != "qwen3_vl":  # one family is enough: it is HF's mechanism (deepstack makes it the hardest)
        pytest.skip("checked on qwen3_vl")
    batch = _batch(family, "pack")
    grads = []
    for checkpointing in (False, True):
        cfg = Config()
        cfg.model.path = family.cfg.model.path
        qwen_vl.configure(cfg)
        cfg.model.gradient_checkpointing = checkpointing
        model = qwen_vl.create_model(cfg, family.ids).train()
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing
        loss, _ = model(batch, loss_only=True)
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(*grads))


# ------------------------------------------------------------------ configure
def test_configure_reads_the_checkpoint(family):
    cfg, path = family.cfg, str(family.path)
    patch = 16 if family.name.startswith("qwen3_vl") else 14
    assert (cfg.image.resize, cfg.image.patch_size, cfg.image.merge_size, cfg.image.temporal_patch_size) == \
        ("smart", patch, 2, 2)
    factor = patch * 2
    assert (cfg.image.min_pixels, cfg.image.max_pixels) == (4 * factor ** 2, 64 * factor ** 2)
    mean = (0.5,) * 3 if family.name.startswith("qwen3_vl") else (0.48145466, 0.4578275, 0.40821073)
    assert np.allclose(cfg.image.image_mean, mean)
    assert cfg.text.tokenizer == path and cfg.text.image_token == "<|image_pad|>"
    again = qwen_vl.configure(cfg)  # idempotent: configured values are not "user changes"
    assert again.image == cfg.image and again.text == cfg.text


def _fresh(path, **changes) -> Config:
    cfg = Config()
    cfg.model.path = str(path)
    for key, value in changes.items():
        section, _, name = key.partition("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return make_qwen_checkpoint(tmp_path_factory.mktemp("cfg_qwen2"), "qwen2_vl", seed=1)


def test_configure_refuses_a_contradicting_patch_size(qwen2_dir):
    with pytest.raises(ValueError, match=r"image\.patch_size = 16 \(--patch-size\).*says 14"):
        qwen_vl.configure(_fresh(qwen2_dir, image__patch_size=16))
    with pytest.raises(ValueError, match=r"image\.image_mean.*contradicts"):
        qwen_vl.configure(_fresh(qwen2_dir, image__image_mean=(0.5, 0.5, 0.5)))
    with pytest.raises(ValueError, match=r"image\.resize = 'fixed'"):
        qwen_vl.configure(_fresh(qwen2_dir, image__resize="fixed"))
    with pytest.raises(ValueError, match=r"text\.image_token = '<image>'.*'<\|image_pad\|>'"):
        qwen_vl.configure(_fresh(qwen2_dir, text__image_token="<image>"))
    same = qwen_vl.configure(_fresh(qwen2_dir, image__patch_size=14))  # agreeing is fine
    assert same.image.patch_size == 14


def test_configure_refuses_a_tokenizer_with_another_image_token_id(qwen2_dir, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["[UNK]", "a", "b", "c", *S.SPECIAL_TOKENS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token=S.PAD_TOKEN).save_pretrained(tmp_path)
    with pytest.raises(ValueError,
                       match=r"--tokenizer .*<\|image_pad\|> is id 10, but the model's image_token_id is 6"):
        qwen_vl.configure(_fresh(qwen2_dir, text__tokenizer=str(tmp_path)))
    ok = qwen_vl.configure(_fresh(qwen2_dir, text__tokenizer=str(SHIPPED_TOKENIZER)))  # same ids: accepted
    assert ok.text.tokenizer == str(SHIPPED_TOKENIZER)


def test_configure_pixel_bounds_old_and_new_files_and_user_choice(qwen2_dir, tmp_path):
    import shutil

    d = tmp_path / "old"
    shutil.copytree(qwen2_dir, d)
    proc = json.loads((d / "preprocessor_config.json").read_text())
    proc.pop("size")
    proc.update(min_pixels=8 * 28 * 28, max_pixels=32 * 28 * 28)  # the Qwen2-VL hub files' keys
    (d / "preprocessor_config.json").write_text(json.dumps(proc))
    cfg = qwen_vl.configure(_fresh(d))
    assert (cfg.image.min_pixels, cfg.image.max_pixels) == (8 * 28 * 28, 32 * 28 * 28)
    # a composite processor_config.json (newer processors) instead of preprocessor_config.json
    (d / "preprocessor_config.json").unlink()
    (d / "processor_config.json").write_text(json.dumps({"image_processor": proc}))
    assert qwen_vl.configure(_fresh(d)).image.max_pixels == 32 * 28 * 28
    # resolution bounds are the user's choice: a changed value is kept, not refused
    mine = qwen_vl.configure(_fresh(qwen2_dir, image__max_pixels=16 * 28 * 28))
    assert mine.image.max_pixels == 16 * 28 * 28 and mine.image.min_pixels == 4 * 28 * 28
    proc["do_normalize"] = False
    (d / "processor_config.json").write_text(json.dumps({"image_processor": proc}))
    with pytest.raises(ValueError, match="do_normalize"):
        qwen_vl.configure(_fresh(d))
    (d / "processor_config.json").unlink()
    with pytest.raises(ValueError, match="no preprocessor_config.json"):
        qwen_vl.configure(_fresh(d))


def test_backend_registry_and_export_round_trip(family, tmp_path):
    from transformers import AutoModelForImageTextToText

    from ray_mmbatch.models import backend_name

    assert backend_name(family.cfg.model) == "qwen_vl"
    qwen_vl.export(family.model, family.cfg, tmp_path)
    back = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    ref = family.model.hf_model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in back.state_dict().items())
    again = qwen_vl.configure(_fresh(tmp_path))
    assert again.image == family.cfg.image and again.text.image_token == family.cfg.text.image_token


def test_the_model_takes_a_batch_as_local_batches_yields_it(family, tmp_path):
    """Issue 25: numpy batches straight from the iterator (no batch_to_torch by hand), same loss as torch."""
    if family.name != "qwen2_vl":
        pytest.skip("checked on qwen2_vl")
    from ray_mmbatch import hf, local_batches
    from ray_mmbatch.synthetic.generate import generate_dataset

    generate_dataset(str(tmp_path / "d"), 12, "parquet", seed=2, workers=1)
    cfg = hf.config_from_checkpoint(str(family.path))
    cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
    model = hf.load_model(str(family.path)).eval()
    batch = next(iter(local_batches(cfg, limit=1)))
    assert isinstance(batch["input_ids"], np.ndarray)
    with torch.no_grad():
        ce, n = model(batch, loss_only=True)
        ce_t, n_t = model(batch_to_torch(batch, "cpu"), loss_only=True)
    assert int(n) == int(n_t) == int(batch["target_tokens"]) > 0
    assert torch.allclose(ce, ce_t)


def test_configure_again_on_a_configured_config_changes_nothing(family):
    """configure is run again on a Config it configured (local_batches, workers): what it adopted from the checkpoint
    (max_video_tokens, fps) is not read as the user's --video-max-tokens / --video-fps the second time (Qwen3-VL's
    per-frame cap turned itself on)."""
    import copy

    cfg = qwen_vl.configure(_fresh(family.path))
    again = qwen_vl.configure(copy.deepcopy(cfg))
    assert again.image == cfg.image and again.text == cfg.text


# ------------------------------------------------------------------ Qwen3-VL-MoE (issue 45, item 5)
@pytest.mark.parametrize("family", ["qwen3_vl_moe"], indirect=True)
def test_moe_freeze_and_lora_keep_packing_exact(family, tmp_path):
    """Qwen3-VL-MoE: --freeze as for Qwen3-VL; LoRA's default targets are the language model's nn.Linear layers,
    so attention is adapted and the routed experts (fused parameters, not nn.Linear) and the router stay frozen,
    as PEFT's all-linear leaves them; a packed batch stays exact through the adapted model, the adapter reloads."""
    samples = family.samples[:2]  # text only, one image; our pixels (packing alone is judged, as for Qwen3.5)
    hf = []
    for s in samples:
        ids = torch.as_tensor(s["input_ids"], dtype=torch.long)[None]
        kw = {}
        if len(s["grids"]):
            kw = {"pixel_values": normalize_patches(torch.as_tensor(s["patches"]), family.cfg.image.image_mean,
                                                    family.cfg.image.image_std, family.cfg.image.temporal_patch_size),
                  "image_grid_thw": torch.as_tensor(s["grids"], dtype=torch.long),
                  "mm_token_type_ids": (ids == family.ids["image_token_id"]).int()}
        hf.append(kw | {"input_ids": s["input_ids"]})
    parts = {"vision": lambda n: ".visual." in n and "merger" not in n,
             "projector": lambda n: ".visual.merger." in n or ".deepstack_merger_list." in n}
    trains = h.check_freeze_and_lora(qwen_vl, family.cfg, load_tokenizer(family.cfg.text.tokenizer), samples, hf,
                                     tmp_path, parts, ".self_attn.q_proj.", family.tol.ce, lora_std=0.1)
    assert not any(".mlp.experts." in n or ".mlp.gate." in n for n in trains)


@pytest.mark.parametrize("family", ["qwen3_vl_moe"], indirect=True)
@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_moe_verify_packing_through_the_data_path(family, tmp_path_factory, mode, capsys):
    data = h.generated_data(tmp_path_factory, "qwen3_vl_moe_verify_data")
    report = h.verify_packing(family.path, data, mode, 1024, capsys, family.tol)
    assert mode == "pad" or report["samples"] > report["batches"]  # a real pack among them
