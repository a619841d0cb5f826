"""The chunked LM head + CE (models/loss.py) equals the unchunked formula, holds at most a chunk of logits, and
is what both model kinds use.

Reference everywhere: ``F.cross_entropy(head(hidden[is_target]).float(), targets)``, the loss before chunking.
Each case takes a chunk smaller than the target count, so several chunks (and the recompute of all but the
last) really run.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ray_mmbatch.models.loss import target_cross_entropy
from ray_mmbatch.schema import IGNORE_INDEX

D, V = 16, 301


def unchunked(head, hidden, labels, reduction):
    is_target = labels != IGNORE_INDEX
    return F.cross_entropy(head(hidden[is_target]).float(), labels[is_target].long(), reduction=reduction)


def case(seed=0, rows=2, length=23):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(D, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g))
    hidden = torch.randn(rows, length, D, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (rows, length), generator=g)
    labels[torch.rand(rows, length, generator=g) < 0.3] = IGNORE_INDEX
    return head, hidden, labels


def loss_and_grads(head, hidden, labels, reduction, loss_fn):
    for t in (hidden, *head.parameters()):
        t.grad = None
    out = loss_fn(head, hidden, labels, reduction)
    weights = torch.linspace(0.5, 1.5, out.numel()).reshape(out.shape)  # 'none': a non-uniform upstream gradient
    (out * weights).sum().backward()
    grads = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters() if p.requires_grad]
    return out.detach(), grads


@pytest.mark.parametrize("reduction", ["sum", "none"])
@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_chunked_equals_unchunked_loss_and_grads(reduction, chunk):
    head, hidden, labels = case()
    n = int((labels != IGNORE_INDEX).sum())
    assert n > 7, "the case must span several chunks"
    want, want_grads = loss_and_grads(head, hidden, labels, reduction, unchunked)
    got, got_grads = loss_and_grads(head, hidden, labels, reduction,
                                    lambda *a: target_cross_entropy(*a, chunk_tokens=chunk))
    assert got.shape == want.shape == ((n,) if reduction == "none" else ())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # 'none': the same values in the same order
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_and_a_wrapped_head():
    """Under bf16 autocast the CE stays fp32 and equals the unchunked one; a head wrapped by LoRA (peft) is
    called as a module, so its adapter weights get the unchunked gradients too."""
    from peft import LoraConfig, inject_adapter_in_model

    head, hidden, labels = case(seed=1)
    holder = nn.Module()
    holder.lm_head = head
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["lm_head"], init_lora_weights=False), holder)
    wrapped = holder.lm_head
    assert type(wrapped) is not nn.Linear and any("lora_" in n for n, _ in wrapped.named_parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, want_grads = loss_and_grads(wrapped, hidden, labels, "none", unchunked)
        got, got_grads = loss_and_grads(wrapped, hidden, labels, "none",
                                        lambda *a: target_cross_entropy(*a, chunk_tokens=5))
    assert got.dtype == torch.float32
    assert len(got_grads) == len(want_grads) == 1 + sum(p.requires_grad for p in wrapped.parameters())
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)  # bf16 matmuls of different row counts
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=5e-2, atol=5e-2 * float(w.abs().max()))


class LargestTensor(TorchDispatchMode):
    """The most elements of any tensor an op makes (forward and backward ops alike)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("chunk", [4, 9])
def test_no_op_makes_more_than_a_chunk_of_logits(chunk):
    """Forward and backward: no tensor of more than chunk x V elements (the logits, their log-softmax and
    gradients); the unchunked formula makes n x V ones, so this would fail without chunks."""
    head, hidden, labels = case(seed=2)
    n = int((labels != IGNORE_INDEX).sum())
    assert n > max(chunk, D)
    for fn, most in ((unchunked, n * V), (lambda *a: target_cross_entropy(*a, chunk_tokens=chunk),
                                          max(chunk, D) * V)):  # D x V: the head's weight gradient
        with LargestTensor() as seen:
            fn(head, hidden, labels, "sum").backward()
        assert seen.most == most


def saved_logit_elements(fn, head, hidden, labels) -> int:
    """Elements of the [*, V] tensors the forward keeps for the backward (all alive at once until it runs), the
    head's own weight aside."""
    kept, weight = [], head.weight.untyped_storage().data_ptr()

    def pack(t):
        if t.shape[-1:] == (V,) and t.untyped_storage().data_ptr() != weight:
            kept.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fn(head, hidden, labels, "sum")
    loss.backward()
    return sum(kept)


def test_the_forward_keeps_one_chunk_of_logits_for_the_backward():
    """Every chunk but the last recomputes its logits in the backward; the unchunked formula keeps n x V."""
    head, hidden, labels = case(seed=4, rows=3)
    n = int((labels != IGNORE_INDEX).sum())
    assert saved_logit_elements(unchunked, head, hidden, labels) >= n * V
    chunked = saved_logit_elements(lambda *a: target_cross_entropy(*a, chunk_tokens=6), head, hidden, labels)
    assert 0 < chunked <= 2 * 6 * V < n * V  # the last chunk's logits and log-softmax at most


def test_no_grad_and_no_targets():
    head, hidden, labels = case(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(target_cross_entropy(head, hidden, labels, "none", chunk_tokens=3),
                                   unchunked(head, hidden, labels, "none"))
    none = torch.full_like(labels, IGNORE_INDEX)
    loss = target_cross_entropy(head, hidden, none, "sum", chunk_tokens=3)
    loss.backward()  # still in the graph: DDP sees the head used on a rank without targets
    assert float(loss.detach()) == 0.0 and head.weight.grad is not None and float(head.weight.grad.abs().sum()) == 0.0
    with pytest.raises(ValueError, match="reduction"):
        target_cross_entropy(head, hidden, labels, "mean")


def _text_pack(vocab: int, lengths=(19, 25, 14), seed=0) -> dict:
    rng = np.random.default_rng(seed)
    ids = rng.integers(10, vocab, sum(lengths)).astype(np.int64)
    labels = np.where(rng.random(ids.size) < 0.6, np.roll(ids, -1), IGNORE_INDEX)
    pos = np.concatenate([np.arange(n) for n in lengths])
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return {"mode": "pack", "input_ids": torch.as_tensor(ids[None]), "labels": torch.as_tensor(labels[None]),
            "position_ids": torch.as_tensor(pos[None]), "cu_seqlens": torch.as_tensor(cu),
            "max_seqlen": int(max(lengths))}


def _model_loss_and_grads(model, batch, chunk):
    model.zero_grad(set_to_none=True)
    model.loss_chunk_tokens = chunk
    ce_sum, n = model(batch, loss_only=True)
    (ce_sum / n).backward()
    return ce_sum.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["builtin", "qwen2_vl"])
def test_models_use_the_chunked_loss(kind, tmp_path):
    """Both model kinds: the loss and every gradient equal with a chunk of 5 targets and with one chunk."""
    torch.manual_seed(0)
    if kind == "builtin":
        from ray_mmbatch.config import ImageConfig, ModelConfig
        from ray_mmbatch.models.builtin import build_model

        model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, vision_d_model=16, vision_heads=2),
                            ImageConfig(), vocab_size=500, image_token_id=3, pad_id=0, seed=0)
        vocab = 500
    else:
        from ray_mmbatch import hf
        from tests.hf_checkpoints import make_qwen_checkpoint

        model = hf.load_model(str(make_qwen_checkpoint(tmp_path / "ck", "qwen2_vl")))
        vocab = model.hf_model.config.text_config.vocab_size
    batch = _text_pack(vocab)
    n = int((batch["labels"] != IGNORE_INDEX).sum())
    assert n > 10
    want, want_grads = _model_loss_and_grads(model, batch, 10 ** 6)
    got, got_grads = _model_loss_and_grads(model, batch, 5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got_grads.keys() == want_grads.keys() and len(want_grads) > 5
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-4, atol=1e-6, msg=k)
    if kind == "qwen2_vl":
        with torch.no_grad():  # target_ce: the per-token values, in order, as verify-packing reads them
            hidden = model.hf_model.model(**model.forward_inputs(batch)).last_hidden_state
            torch.testing.assert_close(model.target_ce(batch), unchunked(model.hf_model.lm_head, hidden,
                                                                         batch["labels"], "none"))
