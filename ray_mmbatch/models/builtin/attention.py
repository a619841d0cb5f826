"""Variable-length attention behind one function, four interchangeable backends.

Every attention call in the model goes through ``attend(q, k, v, layout)``.
The ``AttentionLayout`` says which keys each query may see; the backend only
decides how that is computed::

    pack, 3 samples (cu_seqlens = [0, 3, 5, 8]), causal      pad, 2 rows, causal + key padding
          k: a a a b b c c c                                       k: a a a a -
    q  a     1 . . . . . . .                                   q a   1 . . . .
       a     1 1 . . . . . .                                     a   1 1 . . .
       a     1 1 1 . . . . .                                     a   1 1 1 . .
       b     . . . 1 . . . .                                     a   1 1 1 1 .
       b     . . . 1 1 . . .                                     -   1 1 1 1 1  (pad query: harmless,
       c     . . . . . 1 . .                                                    it carries no target)
       c     . . . . . 1 1 .
       c     . . . . . 1 1 1

Vision attention uses the same pack layout with ``causal=False`` (each image
sees only its own patches).

Backends (``ModelConfig.attention``):

- ``sdpa``: ``F.scaled_dot_product_attention``. Pack layouts never build the
  T x T mask: segments (samples, or images in the vision tower) are sorted by
  length and grouped into buckets whose lengths are within ``BUCKET_RATIO`` of
  the bucket's longest (all segments <= ``BUCKET_FLOOR`` share one bucket); each
  bucket is gathered into a right-padded [n, H, Lmax, D] batch and attended with
  ``is_causal=True`` (a real query never reaches a right pad key) or a key mask
  (vision), then scattered back. Work is sum over buckets of n * Lmax^2 <=
  sum(L_i^2) / BUCKET_RATIO^2 instead of T^2, in a few kernel calls (about
  log(longest / BUCKET_FLOOR) / log(1 / BUCKET_RATIO)); a pad-query / pad-key
  entry only gets zero gradient, so results equal the block mask to fp32
  rounding. On CPU this made packed training several times faster (attention
  had been most of the step; benchmarks/bench_train.py, before/after figures in
  benchmarks/RESULTS.md, "Training throughput"). Pad layouts use the explicit
  [B, 1, L, L] boolean mask (built once per forward, shared by every layer),
  or, when causal with right padding (collate_pad's layout), ``is_causal=True``
  and no mask at all.
  Works on every device, and trains on CPU.
- ``flex``: ``flex_attention`` with a document ``BlockMask`` (compiled on CUDA,
  so fully-masked blocks are skipped). PyTorch has no flex backward on CPU: on
  CPU it is usable for inference only and raises a clear error when training.
- ``flash``: ``flash_attn_varlen_func`` from ``cu_seqlens`` (needs the
  ``flash_attn`` package and CUDA). Pad mode uses ``flash_attn_func`` with
  ``causal=True``: rows are right-padded, so a real query never reaches a pad key.
- ``auto``: flash on CUDA when importable, else sdpa.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "flex", "flash")
BUCKET_RATIO = 0.75   # a segment joins a bucket if it is >= this fraction of the bucket's longest
BUCKET_FLOOR = 64     # segments this short all share one bucket (their attention is cheap anyway)


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(name: str, device: torch.device) -> str:
    """Turn a configured name into a backend that can run on ``device`` (or raise why not)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    if name == "auto":
        return "flash" if device.type == "cuda" and flash_available() else "sdpa"
    if name == "flash":
        if device.type != "cuda":
            raise RuntimeError(f"attention='flash' needs a CUDA device, got {device}; use 'sdpa' or 'auto'")
        if not flash_available():
            raise RuntimeError("attention='flash' needs the flash_attn package (pip install flash-attn); "
                               "use 'sdpa' or 'auto'")
    if name == "flex":
        try:
            from torch.nn.attention import flex_attention  # noqa: F401
        except ImportError as exc:
            raise RuntimeError(f"attention='flex' needs torch>=2.5 ({torch.__version__}): {exc}") from exc
    return name


@dataclass(eq=False)
class AttentionLayout:
    """Who may attend to whom, for one forward pass; masks are built lazily and cached.

    Pack layout: ``cu_seqlens`` (int32 [n+1]) splits one row of length ``length``
    into segments; tokens past ``cu_seqlens[-1]`` (trailing pad) form their own
    segment. Pad layout: ``key_valid`` (bool [B, L], True = real token).
    """

    backend: str
    causal: bool
    length: int
    cu_seqlens: torch.Tensor | None = None
    key_valid: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def segment_ids(self) -> torch.Tensor:
        """Segment index per token, [length]; the trailing pad (if any) is one more segment."""
        if "seg" not in self._cache:
            cu = self.cu_seqlens.to(torch.long)
            lens = cu[1:] - cu[:-1]
            tail = self.length - cu[-1:]
            lens = torch.cat([lens, tail])
            ids = torch.arange(lens.numel(), device=cu.device)
            self._cache["seg"] = torch.repeat_interleave(ids, lens, output_size=self.length)
        return self._cache["seg"]

    def right_padded(self) -> bool:
        """Pad layout whose every row is real tokens then pads (what collate_pad makes)."""
        if "right_padded" not in self._cache:
            v = self.key_valid
            self._cache["right_padded"] = bool(v is not None and torch.equal(v, v.cumprod(dim=1).to(v.dtype)))
        return self._cache["right_padded"]

    def sdpa_mask(self) -> torch.Tensor:
        """Boolean mask for SDPA: [L, L] (pack) or [B, 1, L, L] (pad); True = may attend."""
        if "sdpa" not in self._cache:
            idx = torch.arange(self.length, device=self._device())
            if self.packed:
                seg = self.segment_ids()
                mask = seg[:, None] == seg[None, :]
                if self.causal:
                    mask &= idx[:, None] >= idx[None, :]
            else:
                mask = self.key_valid[:, None, None, :].expand(-1, 1, self.length, -1)
                if self.causal:
                    mask = mask & (idx[:, None] >= idx[None, :])
                # A pad query must see at least one key or SDPA returns NaN, which
                # would then poison gradients through 0 * NaN; let it see itself.
                mask = mask | torch.eye(self.length, dtype=torch.bool, device=mask.device)
            self._cache["sdpa"] = mask
        return self._cache["sdpa"]

    def segment_buckets(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Pack layout -> [(gather index [n, Lmax], key mask [n, 1, 1, Lmax] or None)], plus "inv" cached.

        ``cat(bucket outputs flattened).index_select(inv)`` puts every token back
        in place; pad slots gather their segment's first token and are never read back.
        """
        if "buckets" not in self._cache:
            cu = _cu_with_tail(self).tolist()
            starts, lens = np.array(cu[:-1]), np.diff(cu)
            order = [int(i) for i in np.argsort(-lens, kind="stable") if lens[i] > 0]
            groups: list[list[int]] = []
            for i in order:
                if groups and (lens[i] >= BUCKET_RATIO * lens[groups[-1][0]] or lens[groups[-1][0]] <= BUCKET_FLOOR):
                    groups[-1].append(i)
                else:
                    groups.append([i])
            device = self._device()
            inv = np.empty(self.length, dtype=np.int64)
            buckets, offset = [], 0
            for g in groups:
                width = int(lens[g[0]])
                j = np.arange(width)[None, :]
                real = j < lens[g][:, None]
                index = np.where(real, starts[g][:, None] + j, starts[g][:, None])
                inv[index[real]] = offset + np.flatnonzero(real.reshape(-1))
                offset += index.size
                key_mask = None if self.causal or real.all() else torch.from_numpy(real)[:, None, None, :]
                buckets.append((torch.from_numpy(index).to(device),
                                None if key_mask is None else key_mask.to(device)))
            self._cache["inv"] = torch.from_numpy(inv).to(device)
            self._cache["buckets"] = buckets
        return self._cache["buckets"]

    def flex_block_mask(self):
        if "flex" not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            causal = self.causal
            if self.packed:
                seg = self.segment_ids()

                def mask_mod(b, h, q, kv):
                    same = seg[q] == seg[kv]
                    return same & (q >= kv) if causal else same
                batch = None
            else:
                valid = self.key_valid

                def mask_mod(b, h, q, kv):
                    ok = valid[b, kv] | (q == kv)
                    return ok & (q >= kv) if causal else ok
                batch = valid.shape[0]
            self._cache["flex"] = create_block_mask(mask_mod, batch, None, self.length, self.length,
                                                    device=self._device())
        return self._cache["flex"]

    def _device(self) -> torch.device:
        return (self.cu_seqlens if self.packed else self.key_valid).device


def pack_layout(cu_seqlens: torch.Tensor, length: int, causal: bool, backend: str,
                device: torch.device) -> AttentionLayout:
    cu = cu_seqlens.to(device=device, dtype=torch.int32)
    if cu.ndim != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D starting at 0, got {cu_seqlens.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > length:
        raise ValueError(f"cu_seqlens must be non-decreasing and end <= {length}, got {cu.tolist()}")
    return AttentionLayout(resolve_backend(backend, device), causal, length, cu_seqlens=cu)


def pad_layout(attention_mask: torch.Tensor, causal: bool, backend: str) -> AttentionLayout:
    valid = attention_mask.to(torch.bool)
    return AttentionLayout(resolve_backend(backend, valid.device), causal, valid.shape[1], key_valid=valid)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout) -> torch.Tensor:
    """q, k, v: [B, H, L, D] (B == 1 for pack layouts) -> [B, H, L, D]."""
    if layout.backend == "sdpa":
        if layout.packed:
            return _sdpa_segments(q, k, v, layout)
        if layout.causal and layout.right_padded():
            # a real query never reaches a right pad key under the causal mask, so no mask is
            # needed (and SDPA may pick a fused kernel); pad queries' outputs are never read
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.sdpa_mask())
    if layout.backend == "flex":
        return _flex(q, k, v, layout)
    if layout.backend == "flash":
        return _flash(q, k, v, layout)
    raise ValueError(f"unresolved attention backend {layout.backend!r}")


def _sdpa_segments(q, k, v, layout):
    """Pack layout, one SDPA call per length bucket (see the module docstring)."""
    buckets = layout.segment_buckets()
    if not buckets:                                   # zero-length row: nothing to attend
        return q * 0.0
    if len(buckets) == 1 and buckets[0][0].shape[0] == 1 and buckets[0][1] is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=layout.causal)   # one segment: no gather
    outs = []
    for index, key_mask in buckets:
        n, width = index.shape
        qb, kb, vb = (t[0][:, index].transpose(0, 1) for t in (q, k, v))          # [n, H, Lmax, D]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=key_mask, is_causal=layout.causal)
        outs.append(ob.transpose(0, 1).reshape(q.shape[1], n * width, q.shape[3]))
    return torch.cat(outs, dim=1).index_select(1, layout._cache["inv"])[None]


def _flex(q, k, v, layout):
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type == "cpu":
        if torch.is_grad_enabled() and q.requires_grad:
            raise RuntimeError("attention='flex' cannot train on CPU (PyTorch has no flex backward on CPU); "
                               "use attention='sdpa'")
        with warnings.catch_warnings():
            # Eager flex on CPU is the documented unfused path; the warning says so on every call.
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            return flex_attention(q, k, v, block_mask=layout.flex_block_mask())
    return _compiled_flex()(q, k, v, block_mask=layout.flex_block_mask())


def _flash(q, k, v, layout):
    from flash_attn import flash_attn_func, flash_attn_varlen_func

    # flash-attn wants [tokens, heads, dim] (varlen) or [B, L, H, D]; no fp32.
    out_dtype = q.dtype
    dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
    q, k, v = (t.transpose(1, 2).to(dtype) for t in (q, k, v))
    if layout.packed:
        cu = _cu_with_tail(layout)
        seg_max = int((cu[1:] - cu[:-1]).max())
        out = flash_attn_varlen_func(q[0], k[0], v[0], cu, cu, seg_max, seg_max, causal=layout.causal)
        out = out[None]
    else:
        out = flash_attn_func(q, k, v, causal=layout.causal)
    return out.transpose(1, 2).to(out_dtype)


def _cu_with_tail(layout: AttentionLayout) -> torch.Tensor:
    """cu_seqlens with the trailing pad (if any) as one more segment, so every row is covered."""
    cu = layout.cu_seqlens
    if int(cu[-1]) < layout.length:
        cu = torch.cat([cu, cu.new_tensor([layout.length])])
    return cu
