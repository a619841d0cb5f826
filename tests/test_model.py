"""The model's math: a packed / padded batch computes exactly what each sample alone would.

Batches are built by hand here (numpy, following the layout in
batching/collate.py) from a real tokenizer and real photo crops, so these tests
pin the model to the format rather than to the collate implementation.
The helpers (``make_tokenizer``, ``make_sample``, ``pack``, ``pad``) are
reused by test_step.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import skimage.data
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from ray_mmbatch import schema as S
from ray_mmbatch.config import ImageConfig, ModelConfig
from ray_mmbatch.models.builtin import build_model
from ray_mmbatch.models.builtin.rope import patch_positions
from ray_mmbatch.train.step import batch_to_torch

PS, M = 14, 2
WORDS = ("user assistant describe the picture what colour is it a an red green blue yellow white black "
         "cat astronaut coffee cup photo of and with two images text only here answer").split()
PHOTOS = {"astronaut": skimage.data.astronaut(), "coffee": skimage.data.coffee(), "chelsea": skimage.data.chelsea()}


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A real (tiny, word-level) HF fast tokenizer with the project's special tokens."""
    vocab = {t: i for i, t in enumerate(S.SPECIAL_TOKENS + ("<unk>",) + tuple(WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token=S.PAD_TOKEN)
    fast.add_special_tokens({"additional_special_tokens": list(S.SPECIAL_TOKENS)})
    return fast


def patchify(img: np.ndarray) -> np.ndarray:
    """[gh*ps, gw*ps, 3] uint8 -> [gh*gw, 3*ps*ps] in merge-window order, channel-major patches."""
    gh, gw = img.shape[0] // PS, img.shape[1] // PS
    x = img.reshape(gh // M, M, PS, gw // M, M, PS, 3)      # bh i py bw j px c
    x = x.transpose(0, 3, 1, 4, 6, 2, 5)                      # bh bw i j c py px
    return np.ascontiguousarray(x.reshape(gh * gw, 3 * PS * PS))


def crop(name: str, gh: int, gw: int, y: int = 0, x: int = 0) -> np.ndarray:
    return PHOTOS[name][y:y + gh * PS, x:x + gw * PS, :3]


def make_sample(tok, prompt: str, answer: str, images: list[np.ndarray] = ()) -> dict:
    """One materialized sample: ids with expanded image tokens, shifted labels, patches, grids."""
    pads = "".join(f" {S.VISION_START}" + f" {S.IMAGE_PAD}" * ((im.shape[0] // PS) * (im.shape[1] // PS) // M ** 2)
                   + f" {S.VISION_END}" for im in images)
    head = f"{S.IM_START} user{pads} {prompt} {S.IM_END} {S.IM_START} assistant"
    tail = f" {answer} {S.IM_END}"
    head_ids = tok(head, add_special_tokens=False)["input_ids"]
    ids = np.array(head_ids + tok(tail, add_special_tokens=False)["input_ids"], np.int32)
    is_target = np.zeros(len(ids), bool)
    is_target[len(head_ids):] = True
    labels = np.full(len(ids), S.IGNORE_INDEX, np.int32)
    labels[:-1] = np.where(is_target[1:], ids[1:], S.IGNORE_INDEX)
    grids = np.array([(1, im.shape[0] // PS, im.shape[1] // PS) for im in images], np.int32).reshape(-1, 3)
    patches = (np.concatenate([patchify(im) for im in images]) if images
               else np.zeros((0, 3 * PS * PS), np.uint8))
    return {"input_ids": ids, "labels": labels, "grids": grids, "patches": patches}


def _vision(samples):
    grids = np.concatenate([s["grids"] for s in samples]).astype(np.int32).reshape(-1, 3)
    per_img = grids.prod(axis=1)
    return {"patches": np.concatenate([s["patches"] for s in samples]),
            "image_grid_thw": grids,
            "image_sample_index": np.concatenate([np.full(len(s["grids"]), i, np.int32)
                                                  for i, s in enumerate(samples)]),
            "vision_cu_seqlens": np.concatenate([[0], np.cumsum(per_img)]).astype(np.int32)}


def pack(samples: list[dict], tail_pad: int = 0, pad_id: int = 0) -> dict:
    lens = np.array([len(s["input_ids"]) for s in samples], np.int32)
    ids = np.concatenate([s["input_ids"] for s in samples] + [np.full(tail_pad, pad_id, np.int32)])
    labels = np.concatenate([s["labels"] for s in samples] + [np.full(tail_pad, S.IGNORE_INDEX, np.int32)])
    pos = np.concatenate([np.arange(n) for n in lens] + [np.arange(tail_pad)]).astype(np.int32)
    return {"mode": "pack", "input_ids": ids[None], "labels": labels[None], "position_ids": pos[None],
            "cu_seqlens": np.concatenate([[0], np.cumsum(lens)]).astype(np.int32), "max_seqlen": int(lens.max()),
            "seq_lens": lens, "real_tokens": int(lens.sum()), "target_tokens": int((labels != -100).sum()),
            "sample_ids": [f"s{i}" for i in range(len(samples))], **_vision(samples)}


def pad(samples: list[dict], pad_id: int = 0) -> dict:
    lens = np.array([len(s["input_ids"]) for s in samples], np.int32)
    b, width = len(samples), int(lens.max())
    ids = np.full((b, width), pad_id, np.int32)
    labels = np.full((b, width), S.IGNORE_INDEX, np.int32)
    pos = np.zeros((b, width), np.int32)
    mask = np.zeros((b, width), bool)
    for i, s in enumerate(samples):
        n = lens[i]
        ids[i, :n], labels[i, :n], pos[i, :n], mask[i, :n] = s["input_ids"], s["labels"], np.arange(n), True
    return {"mode": "pad", "input_ids": ids, "labels": labels, "position_ids": pos, "attention_mask": mask,
            "seq_lens": lens, "real_tokens": int(lens.sum()), "target_tokens": int((labels != -100).sum()),
            "sample_ids": [f"s{i}" for i in range(b)], **_vision(samples)}


def tiny_model(tok, attention: str = "sdpa", seed: int = 0, **overrides):
    cfg = ModelConfig(attention=attention, d_model=64, n_layers=2, n_heads=4, vision_d_model=48,
                      vision_layers=2, vision_heads=2, **overrides)
    image_id = tok.convert_tokens_to_ids(S.IMAGE_PAD)
    model = build_model(cfg, ImageConfig(patch_size=PS, merge_size=M), len(tok), image_id,
                        tok.convert_tokens_to_ids(S.PAD_TOKEN), seed=seed)
    return model.eval()


def four_samples(tok) -> list[dict]:
    """Different image grids, two images in one sample, one text-only sample."""
    return [make_sample(tok, "describe the picture", "a photo of an astronaut", [crop("astronaut", 4, 6)]),
            make_sample(tok, "what colour is it", "text only here"),
            make_sample(tok, "two images", "a cat and a coffee cup",
                        [crop("chelsea", 2, 2, 50, 80), crop("coffee", 4, 4, 100, 100)]),
            make_sample(tok, "describe the picture", "a cup of coffee", [crop("coffee", 6, 2, 30, 200)])]


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """These tensors are tiny; with 2 intra-op threads on a loaded 2-core box, OpenMP
    spin-waiting made a 12 ms step take 200 ms. Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def t(batch):
    return batch_to_torch(batch, "cpu")


def per_token_ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits, labels.long(), ignore_index=S.IGNORE_INDEX, reduction="none")


@pytest.mark.parametrize("tail_pad", [0, 7])
def test_pack_equals_each_sample_alone(tok, tail_pad):
    model, samples = tiny_model(tok), four_samples(tok)
    batch = t(pack(samples, tail_pad=tail_pad))
    with torch.no_grad():
        logits = model(batch)[0]
        ce_sum, n_target = model(batch, loss_only=True)
        offsets = batch["cu_seqlens"].tolist()
        for i, s in enumerate(samples):
            alone = t(pack([s]))
            ref = model(alone)[0]
            got = logits[offsets[i]:offsets[i + 1]]
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(per_token_ce(got, alone["labels"][0]),
                                       per_token_ce(ref, alone["labels"][0]), atol=1e-5, rtol=1e-5)
        ref_sum = sum(model(t(pack([s])), loss_only=True)[0] for s in samples)
    assert int(n_target) == sum(int((s["labels"] != -100).sum()) for s in samples)
    torch.testing.assert_close(ce_sum, ref_sum, atol=1e-4, rtol=1e-6)
    # and the logits-free loss agrees with CE over the full logits
    torch.testing.assert_close(ce_sum, per_token_ce(logits, batch["labels"][0]).sum(), atol=1e-4, rtol=1e-6)


def test_pad_rows_equal_each_sample_alone(tok):
    model, samples = tiny_model(tok), four_samples(tok)
    batch = t(pad(samples))
    with torch.no_grad():
        logits = model(batch)
        for i, s in enumerate(samples):
            ref = model(t(pack([s])))[0]
            torch.testing.assert_close(logits[i, :len(s["input_ids"])], ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(model(batch, loss_only=True)[0], model(t(pack(samples)), loss_only=True)[0],
                                   atol=1e-4, rtol=1e-6)


def test_pad_and_pack_give_the_same_gradients(tok):
    """Pad mode attends with is_causal and no mask (right padding): the pad positions'
    outputs must not reach any real token, forward or backward."""
    model, samples = tiny_model(tok), four_samples(tok)
    grads = []
    for batch in (t(pad(samples)), t(pack(samples))):
        model.zero_grad()
        loss, n = model(batch, loss_only=True)
        loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-4, rtol=1e-4, msg=k)


def test_only_right_padding_skips_the_mask():
    from ray_mmbatch.models.builtin.attention import pad_layout

    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    holes = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [1, 0, 1, 0]])
    assert pad_layout(right, causal=True, backend="sdpa").right_padded()
    assert not pad_layout(holes, causal=True, backend="sdpa").right_padded()


def test_leaking_across_samples_would_be_detected(tok):
    """Guard for the tests above: a plain causal mask over the pack gives different logits."""
    model, samples = tiny_model(tok), four_samples(tok)
    batch = t(pack(samples))
    leaky = dict(batch, cu_seqlens=torch.tensor([0, int(batch["cu_seqlens"][-1])], dtype=torch.int32))
    with torch.no_grad():
        start = int(batch["cu_seqlens"][1])
        diff = (model(batch)[0, start:] - model(leaky)[0, start:]).abs().max()
    assert diff > 1e-3


def test_vision_attention_is_isolated_per_image(tok):
    model, samples = tiny_model(tok), four_samples(tok)
    batch = t(pack(samples))
    n1 = int(batch["image_grid_thw"][0].prod()) // M ** 2
    changed = dict(batch, patches=batch["patches"].clone())
    start, end = batch["vision_cu_seqlens"][1:3].tolist()
    changed["patches"][start:end] = 255 - changed["patches"][start:end]     # image 2's pixels
    n2 = (end - start) // M ** 2
    with torch.no_grad():
        a, b = model.image_features(batch), model.image_features(changed)
        assert torch.equal(a[:n1], b[:n1])
        assert (a[n1:n1 + n2] - b[n1:n1 + n2]).abs().max() > 1e-3
        torch.testing.assert_close(a[n1 + n2:], b[n1 + n2:], atol=0, rtol=0)
        # the LM is not isolated across images of the same sample, but sample 1 is untouched
        cu = batch["cu_seqlens"].tolist()
        torch.testing.assert_close(model(batch)[0, :cu[1]], model(changed)[0, :cu[1]], atol=0, rtol=0)


def test_patch_positions_follow_merge_window_order():
    pos = patch_positions(torch.tensor([[1, 4, 6]]), merge=2).tolist()
    assert pos[:8] == [[0, 0], [0, 1], [1, 0], [1, 1], [0, 2], [0, 3], [1, 2], [1, 3]]
    assert pos[12:16] == [[2, 0], [2, 1], [3, 0], [3, 1]]
    assert sorted(map(tuple, pos)) == [(r, c) for r in range(4) for c in range(6)]


def test_patchify_helper_matches_positions():
    """The test helper (our stand-in for data/image.py) agrees with the model's idea of where patches are."""
    img = crop("astronaut", 4, 6)
    patches = patchify(img)
    for k, (r, c) in enumerate(patch_positions(torch.tensor([[1, 4, 6]]), merge=2).tolist()):
        expect = img[r * PS:(r + 1) * PS, c * PS:(c + 1) * PS].transpose(2, 0, 1).reshape(-1)
        assert np.array_equal(patches[k], expect)


def test_flex_matches_sdpa_for_inference_on_cpu(tok):
    samples = four_samples(tok)
    sdpa, flex = tiny_model(tok, "sdpa"), tiny_model(tok, "flex")
    for batch in (t(pack(samples, tail_pad=3)), t(pad(samples))):
        with torch.no_grad():
            if batch["mode"] == "pack":      # compare real tokens only, not the trailing pad
                real = torch.zeros_like(batch["input_ids"], dtype=torch.bool)
                real[0, :int(batch["cu_seqlens"][-1])] = True
            else:
                real = batch["attention_mask"].bool()
            torch.testing.assert_close(flex(batch)[real], sdpa(batch)[real], atol=1e-5, rtol=1e-5)


def test_flex_training_on_cpu_is_a_clear_error(tok):
    model = tiny_model(tok, "flex").train()
    with pytest.raises(RuntimeError, match="cannot train on CPU"):
        model(t(pack(four_samples(tok)[:1])), loss_only=True)


def test_backend_errors_are_clear(tok):
    with pytest.raises(ValueError, match="unknown attention backend"):
        tiny_model(tok, "xformers")
    with pytest.raises(RuntimeError, match="flash.*CUDA"):
        tiny_model(tok, "flash")(t(pack(four_samples(tok)[:1])))


def test_auto_uses_sdpa_on_cpu(tok):
    samples = four_samples(tok)
    batch = t(pack(samples))
    with torch.no_grad():
        torch.testing.assert_close(tiny_model(tok, "auto")(batch), tiny_model(tok, "sdpa")(batch), atol=0, rtol=0)


def test_bad_batches_raise(tok):
    model, samples = tiny_model(tok), four_samples(tok)
    good = t(pack(samples))
    image_id = tok.convert_tokens_to_ids(S.IMAGE_PAD)
    one_less = dict(good, input_ids=good["input_ids"].clone())
    one_less["input_ids"][good["input_ids"] == image_id] = tok.convert_tokens_to_ids("the")
    bad_grid = dict(good, image_grid_thw=good["image_grid_thw"].flip(0))
    bad_cu = dict(good, vision_cu_seqlens=good["vision_cu_seqlens"] + 0)
    bad_cu["vision_cu_seqlens"][1] += 4
    odd_grid = dict(good, image_grid_thw=good["image_grid_thw"].clone())
    odd_grid["image_grid_thw"][0] = torch.tensor([2, 2, 6])
    cases = [(one_less, "image tokens"), (bad_cu, "vision_cu_seqlens"), (odd_grid, "t == 1"),
             (dict(good, mode="ragged"), "mode"), (dict(good, patches=good["patches"][:, :10]), "patches"),
             (dict(good, cu_seqlens=torch.tensor([0, 5, 3], dtype=torch.int32)), "cu_seqlens")]
    with torch.no_grad():
        for batch, msg in cases:
            with pytest.raises(ValueError, match=msg):
                model(batch)
        # a reordered grid still sums right but cannot match the per-image cu_seqlens
        with pytest.raises(ValueError):
            model(bad_grid)


def test_default_model_is_small(tok):
    cfg, image = ModelConfig(attention="sdpa"), ImageConfig()
    model = build_model(cfg, image, 8192, 8191, 0, seed=0)
    n = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n < 5e6, n


# ------------------------------------------------ sdpa pack path: length buckets, no T x T mask
SEGMENT_CASES = {
    "mixed, tail pad": ([0, 1, 40, 41, 300, 420, 470, 600, 603], 640),
    "empty segments": ([0, 0, 17, 17, 90, 90], 90),
    "one segment + tail": ([0, 250], 256),
    "one segment": ([0, 200], 200),
    "many short": (list(range(0, 500, 5)), 497),
}


def _masked_reference(q, k, v, layout):
    """What the sdpa backend computed before buckets: one call over the full T x T block mask."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.sdpa_mask())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", sorted(SEGMENT_CASES))
def test_sdpa_segment_buckets_equal_block_mask(case, causal):
    from ray_mmbatch.models.builtin import attend, pack_layout

    cu, length = SEGMENT_CASES[case]
    gen = torch.Generator().manual_seed(len(cu))
    q, k, v = (torch.randn(1, 4, length, 16, generator=gen, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(1, 4, length, 16, generator=gen)
    results = []
    for fn in (attend, _masked_reference):
        layout = pack_layout(torch.tensor(cu), length, causal=causal, backend="sdpa", device=torch.device("cpu"))
        out = fn(q, k, v, layout)
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        results.append((out, *grads))
    for got, ref, name in zip(results[0], results[1], ("out", "dq", "dk", "dv")):
        torch.testing.assert_close(got, ref, atol=2e-6, rtol=1e-5, msg=f"{case} causal={causal}: {name}")


def test_segment_buckets_cover_every_token_once_and_bound_the_work():
    from ray_mmbatch.models.builtin import pack_layout
    from ray_mmbatch.models.builtin.attention import BUCKET_FLOOR, BUCKET_RATIO

    rng = np.random.default_rng(0)
    lens = np.concatenate([rng.integers(1, 64, 40), rng.integers(64, 3000, 12)])
    rng.shuffle(lens)
    cu = np.concatenate([[0], np.cumsum(lens)])
    length = int(cu[-1]) + 9
    layout = pack_layout(torch.tensor(cu), length, causal=True, backend="sdpa", device=torch.device("cpu"))
    buckets = layout.segment_buckets()
    seen = np.concatenate([idx[idx >= 0].numpy().reshape(-1) for idx, _ in buckets])
    slots = sum(idx.numel() for idx, _ in buckets)
    inv = layout._cache["inv"].numpy()
    assert sorted(inv.tolist()) == sorted(set(inv.tolist())) and inv.max() < slots   # a distinct slot per token
    flat = np.concatenate([idx.numpy().reshape(-1) for idx, _ in buckets])
    assert (flat[inv] == np.arange(length)).all()                                       # and it is that token
    assert set(seen.tolist()) == set(range(length))
    work = sum(idx.shape[0] * idx.shape[1] ** 2 for idx, _ in buckets)
    all_lens = np.append(lens, 9)
    assert work <= (np.maximum(all_lens / BUCKET_RATIO, BUCKET_FLOOR) ** 2).sum()
    assert work < 0.2 * length ** 2                                                     # vs the T x T mask
    assert len(buckets) <= 1 + np.ceil(np.log(all_lens.max() / BUCKET_FLOOR) / np.log(1 / BUCKET_RATIO)) + 1


def test_the_builtin_model_takes_numpy_batches(tok):
    """Issue 25: the batch as the iterators yield it (numpy) gives the loss of its torch copy."""
    model, batch = tiny_model(tok), pack(four_samples(tok))
    assert isinstance(batch["input_ids"], np.ndarray)
    with torch.no_grad():
        ce, n = model(batch, loss_only=True)
        ce_t, n_t = model(t(batch), loss_only=True)
    assert int(n) == int(n_t) > 0 and torch.equal(ce, ce_t)
