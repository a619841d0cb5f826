"""Shared check that a backend hands flash attention the packed row's varlen metadata
(hf_common.varlen_kwargs): an attention function registered under a name with "flash" in it records
its kwargs and, given cu_seq_lens, runs each packed sample alone through sdpa (as flash varlen does),
so the loss is exact only if the boundaries reached it; without them it attends across samples."""
from __future__ import annotations

import contextlib

import torch

NAME = "recording_flash_sdpa"
KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
RECORDED: list[dict] = []


def _recording_flash_sdpa(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    RECORDED.append({k: kwargs.get(k) for k in KEYS})
    cu = kwargs.pop("cu_seq_lens_q", None)
    for k in ("cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids"):
        kwargs.pop(k, None)
    if cu is None:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    kwargs["is_causal"] = True
    outs = [sdpa_attention_forward(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], None, **kwargs)[0]
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    return torch.cat(outs, dim=1), None


@contextlib.contextmanager
def flash_named(text_config):
    """The language model on the recording function for the duration (its config restored after)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, _recording_flash_sdpa)
    before = text_config._attn_implementation
    text_config._attn_implementation = NAME
    RECORDED.clear()
    try:
        yield RECORDED
    finally:
        text_config._attn_implementation = before


def check_varlen(model, text_config, batch: dict, reference: torch.Tensor, tol: float) -> float:
    """Pack ``batch`` through the recording function: the kwargs reach every decoder layer with the
    row's cu_seqlens, the per-token CE equals ``reference`` within ``tol`` (the family's
    family_harness.TOLERANCE ``ce``); dropping them moves it by more than 100 x ``tol``. Returns the diff."""
    with flash_named(text_config) as recorded, torch.no_grad():
        ce = model.target_ce(batch)
        calls = [r for r in recorded if r["cu_seq_lens_q"] is not None]
        assert calls and len(calls) == text_config.num_hidden_layers, recorded
        for r in calls:
            assert r["cu_seq_lens_q"].dtype == torch.int32
            assert r["cu_seq_lens_q"].tolist() == torch.as_tensor(batch["cu_seqlens"]).tolist()
            assert r["cu_seq_lens_k"] is r["cu_seq_lens_q"] and r["max_length_q"] == r["max_length_k"]
            assert isinstance(r["max_length_q"], int) and r["max_length_q"] == int(batch["max_seqlen"])
        diff = float((ce - reference).abs().max())
        kwargs = model.forward_inputs(batch)
        for k in KEYS:
            kwargs.pop(k)
        hidden = model.hf_model.model(**kwargs).last_hidden_state
        naive = model._target_ce(hidden, batch["labels"], "none")
    assert diff < tol, diff
    assert float((naive - reference).abs().max()) > 100 * tol  # the control: no boundaries, samples mix
    return diff
