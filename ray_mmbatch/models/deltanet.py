"""Gated DeltaNet layers (Qwen3.5) over a packed row: every sample starts from a zero recurrent state and an
empty convolution window, as it does when run alone.

A Gated DeltaNet layer carries two things along the sequence: the delta rule's recurrent state S (per value
head, k_dim x v_dim) and a depthwise causal convolution of width K (4) over q / k / v. In a packed row::

    tokens        a0 a1 a2 | b0 b1 b2 b3 | c0 c1
    conv window   ....a0 a1 a2 -> b0 sees only b0 (a1 a2 are not in its window)
    state         S = 0 at a0, S = 0 again at b0, S = 0 again at c0

transformers hands the boundaries to the kernels only: ``chunk_gated_delta_rule(cu_seqlens=...)`` of ``fla``
(and only when flash attention's ``cu_seq_lens_q`` is in the kwargs); nothing gives causal-conv1d its
``seq_idx``. Its torch fallbacks take neither, so HF's packed forward carries a's state and conv window into b
(tests/test_models_qwen3_5.py measures the leak), and with ``cu_seqlens`` on CPU the fallback refuses to run.

``install(hf_model)`` replaces the ``forward`` of every ``*GatedDeltaNet`` module (instance attribute: the
weights, their names and the class stay HF's, so export / FSDP / LoRA see the same model; ``ensure`` puts it
back where transformers' ``train()`` reset it) by
``segmented_forward``, which takes the row's sample boundaries as the keyword ``SEGMENTS`` (a tuple of ints, the
packed batch's cu_seqlens; the Qwen3.5 adapter adds it in pack mode only) and runs:

- on CUDA with ``fla`` and ``causal_conv1d`` installed: the kernels with the boundaries
  (``chunk_gated_delta_rule(cu_seqlens=...)``, ``causal_conv1d_fn(seq_idx=...)``), one pass over the row;
- otherwise, the exact torch path: HF's own layer forward on the samples as segments. Samples with the same
  number of 64-token chunks (the chunked rule's block) run together as one right-padded batch (the layer is
  causal, so padding after a sample changes none of its outputs); the rest one group at a time. Cost: the
  same arithmetic as the samples alone, plus < 64 padding tokens per sample; one Python-level call per
  distinct chunk count (benchmarks/bench_deltanet.py measures it against the padded batch).

Without ``SEGMENTS`` (pad mode, a single sample, generation with a cache) HF's forward runs unchanged.
"""
from __future__ import annotations

import types

import torch

SEGMENTS = "deltanet_cu_seqlens"
CHUNK = 64  # transformers' torch_chunk_gated_delta_rule block
_VARLEN = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_deltanet(module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet")


def install(hf_model) -> list:
    """Route every Gated DeltaNet layer of ``hf_model`` through ``segmented_forward``; returns them (for ``ensure``)."""
    layers = [m for m in hf_model.modules() if is_deltanet(m)]
    ensure(layers)
    return layers


def ensure(layers: list) -> None:
    """Route ``layers`` through ``segmented_forward`` again where something reset their forward: transformers'
    ``train()`` re-kernelizes the model (the ``kernels`` package), and kernels' ``_replace_forward`` drops an
    instance ``forward``, so after ``model.train()`` HF's forward would run again, leaking across samples. The
    adapter calls this at every forward (a dict lookup per layer)."""
    for module in layers:
        if getattr(module.__dict__.get("forward"), "__func__", None) is not segmented_forward:
            module.forward = types.MethodType(segmented_forward, module)


def kernels_available(device: torch.device) -> bool:
    """fla's chunk_gated_delta_rule and causal-conv1d's causal_conv1d_fn importable, on a CUDA device."""
    if device.type != "cuda":
        return False
    try:
        from causal_conv1d import causal_conv1d_fn  # noqa: F401
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


def segmented_forward(self, hidden_states: torch.Tensor, cache=None, attention_mask=None, **kwargs):
    """A Gated DeltaNet layer's forward with each sample of the packed row ``SEGMENTS`` isolated (module doc)."""
    bounds = kwargs.pop(SEGMENTS, None)
    hf_forward = type(self).forward
    if bounds is None or cache is not None:
        return hf_forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    for key in _VARLEN:  # flash attention's varlen kwargs: HF would hand them to the torch fallback, which refuses
        kwargs.pop(key, None)
    bounds = [int(b) for b in bounds]
    if hidden_states.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != hidden_states.shape[1]:
        raise ValueError(f"{SEGMENTS} {bounds[:3]}...{bounds[-1:]} do not cover the packed row of shape "
                         f"{tuple(hidden_states.shape)}")
    if len(bounds) == 2:
        return hf_forward(self, hidden_states, **kwargs)
    if kernels_available(hidden_states.device):
        return kernel_forward(self, hidden_states, bounds)
    return torch_segments_forward(self, hidden_states, bounds, lambda x: hf_forward(self, x, **kwargs))


def torch_segments_forward(self, hidden_states: torch.Tensor, bounds: list[int], layer) -> torch.Tensor:
    """``layer`` (HF's forward) on the samples ``bounds`` of the row: those of one chunk count as one batch."""
    groups: dict[int, list[int]] = {}
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        groups.setdefault(-(-(b - a) // CHUNK), []).append(i)
    outs: list[torch.Tensor | None] = [None] * (len(bounds) - 1)
    row = hidden_states[0]
    for members in groups.values():
        spans = [(bounds[i], bounds[i + 1]) for i in members]
        if len(members) == 1:
            (a, b), = spans
            outs[members[0]] = layer(row[a:b][None])[0]
            continue
        width = max(b - a for a, b in spans)
        x = row.new_zeros(len(spans), width, row.shape[-1])
        for j, (a, b) in enumerate(spans):
            x[j, :b - a] = row[a:b]
        y = layer(x)
        for j, (i, (a, b)) in enumerate(zip(members, spans)):
            outs[i] = y[j, :b - a]
    return torch.cat(outs, dim=0)[None]


def kernel_forward(self, hidden_states: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """HF's Gated DeltaNet forward (transformers 5.25, no cache) with the kernels told the boundaries: fla's
    chunk rule ``cu_seqlens``, causal-conv1d ``seq_idx`` (the sample index of each token)."""
    import torch.nn.functional as F
    from causal_conv1d import causal_conv1d_fn
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    _, seq_len, _ = hidden_states.shape
    cu = torch.tensor(bounds, dtype=torch.int32, device=hidden_states.device)
    lens = cu[1:] - cu[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(len(bounds) - 1, dtype=torch.int32, device=cu.device),
                                      lens)[None]
    mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)  # [1, D, T], channel-last in memory
    z = self.in_proj_z(hidden_states).reshape(1, seq_len, -1, self.head_v_dim)
    b, a = self.in_proj_b(hidden_states), self.in_proj_a(hidden_states)
    mixed_qkv = causal_conv1d_fn(mixed_qkv, self.conv1d.weight.squeeze(1), self.conv1d.bias, seq_idx=seq_idx,
                                 activation=self.activation).transpose(1, 2)
    query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
    query = query.reshape(1, seq_len, -1, self.head_k_dim)
    key = key.reshape(1, seq_len, -1, self.head_k_dim)
    value = value.reshape(1, seq_len, -1, self.head_v_dim)
    beta = b.sigmoid()
    g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
    if self.num_v_heads != self.num_k_heads:  # fla wants as many q / k heads as v heads
        query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
        key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
    out, _ = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, initial_state=None,
                                    output_final_state=False, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long())
    out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(1, seq_len, -1))
