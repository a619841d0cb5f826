"""Peak memory per GPU of a training step, estimated from the run's settings; and measured, to compare.

Parameters are counted exactly: the run's model is built on the ``meta`` device (no weight is read or
allocated), frozen parts and LoRA applied as a run applies them (models/trainable.py), and split into
language and vision (tower + projector). The rest is a formula per item, in bytes (docs/memory.md draws it)::

    weights      P x 4 (the project keeps fp32 weights; autocast makes the bf16 copies)
                 + Pt x 2 with bf16 autocast (its cache of the trainable weights' bf16 copies)
                 QLoRA: each 4-bit linear weight 0.5 + 0.016 (NF4 + double-quantized scales), the rest fp32
                 FSDP: P x 4 / W + the root unit and two decoder blocks unsharded (bf16 with bf16 precision)
    gradients    Pt x 4                                      (FSDP: / W)
    optimizer    Pt x 8: AdamW's fp32 m and v; no fp32 master copy (the weights are fp32 already)   (FSDP: / W)
    activations  T x L x (4 x 4d + a x (4d + 2 kv + 4 i))    per decoder layer, saved for the backward
                                                             (kv = d with sdpa and a mask: k, v repeated)
                 T x L x 4 x d + one layer's                 with gradient checkpointing (layer inputs only)
                 + T x 3d x 4                                the final norm and the head's input
                 + vision: patches x Lv x a x (8 dv + 2 iv)  (4 iv for a gated MLP), with --max-patches;
                   checkpointed: patches x (Lv x 4 dv + one layer's)
                 + T^2 x (1 + L x a) with sdpa (the batch's bool mask, and each layer's additive copy,
                   saved for its backward), + L x heads x T^2 x 2a more with eager attention; none with flash
    logits       3 x C x V x 4, C = min(chunk, targets)      models/loss.py's chunk in its backward: the fp32
                                                             log-softmax, its gradient, the logits' gradient

    T tokens of one batch (--max-tokens), L layers, d hidden, kv = kv_heads x head_dim, i intermediate,
    V vocabulary, a = 2 with bf16 autocast else 4, P all parameters, Pt the trainable ones, W workers.

The total is the sum, an upper bound: in the backward, gradients grow as activations are freed (and in
pad mode the masks are rows x longest^2, at most T^2). train/peak.py measures what a step really takes;
benchmarks/bench_memory.py compares the two, and the figures are in benchmarks/RESULTS.md ("Memory (issue
43)"). No Ray here.
"""
from __future__ import annotations

import dataclasses
from typing import Any

GiB = 1024 ** 3


@dataclasses.dataclass(frozen=True)
class Stack:
    """One transformer stack's shape: width, MLP width, layers, heads."""
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_dim: int
    gated: bool = True


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """What the estimate reads of a model: exact parameter counts and the stacks' shapes."""
    name: str
    language_params: int
    vision_params: int          # vision tower + projector
    trainable_params: int       # after --freeze / --lora-rank
    quantized_params: int       # in 4-bit linear layers (--qlora), else 0
    root_params: int            # outside the decoder blocks (FSDP's root unit)
    block_params: int           # the largest decoder block
    vocab: int
    text: Stack
    vision: Stack | None

    @property
    def total_params(self) -> int:
        return self.language_params + self.vision_params


@dataclasses.dataclass(frozen=True)
class Item:
    name: str
    bytes: float
    formula: str


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def _stack(c: Any, gated: bool, width: tuple[str, ...] = ("hidden_size", "d_model")) -> Stack:
    hidden = int(_get(c, *width))
    inter = _get(c, "intermediate_size")
    inter = int(inter) if inter else int(hidden * float(_get(c, "mlp_ratio", default=4.0)))
    heads = int(_get(c, "num_attention_heads", "num_heads", "n_heads"))
    head_dim = int(_get(c, "head_dim", default=0) or hidden // heads)
    kv = int(_get(c, "num_key_value_heads", default=heads)) * head_dim
    return Stack(hidden, inter, int(_get(c, "num_hidden_layers", "depth", "n_layers")), heads, kv, gated)


def model_spec(cfg) -> ModelSpec:
    """The run's model (``cfg.model``: checkpoint or built-in) built on the meta device, counted as a run trains it."""
    import torch

    from ray_mmbatch.models import trainable as T

    with torch.device("meta"):
        if cfg.model.path:
            from transformers import AutoConfig, AutoModelForImageTextToText

            from ray_mmbatch.formats.fetch import local_checkpoint
            from ray_mmbatch.models.hf_common import HFModel

            hf_cfg = AutoConfig.from_pretrained(local_checkpoint(cfg.model.path))  # a bucket's: this node's copy
            model = HFModel(AutoModelForImageTextToText.from_config(hf_cfg), lambda batch: {}, lambda m: [])
            text_cfg = hf_cfg.get_text_config()
            vision_cfg = _get(hf_cfg, "vision_config")
            vocab, name = int(text_cfg.vocab_size), f"{cfg.model.path} ({hf_cfg.model_type})"
            blocks = [m for m in model.modules() if type(m).__name__ in set(model.hf_model._no_split_modules or ())]
        else:
            from ray_mmbatch.models import token_ids
            from ray_mmbatch.models.builtin import build_model

            ids = token_ids(cfg)
            model = build_model(cfg.model, cfg.image, ids["vocab_size"], ids["image_token_id"], ids["pad_id"])
            text_cfg, vocab, name = cfg.model, model.vocab_size, "builtin"
            vision_cfg = dataclasses.replace(cfg.model, d_model=cfg.model.vision_d_model,
                                             n_layers=cfg.model.vision_layers, n_heads=cfg.model.vision_heads)
            blocks = list(model.decoder.blocks) + list(model.vision.blocks)
        parts = T.part_parameters(model)
        vision_ids = {id(p) for part in ("vision", "projector") for _, p in parts[part]}
        before = {id(p) for p in model.parameters()}
        if int(cfg.model.lora_rank) > 0 or cfg.model.freeze:
            T.configure_trainable(model, cfg)
    params = {id(p): p for p in model.parameters()}
    added = sum(p.numel() for i, p in params.items() if i not in before)   # LoRA's A and B
    vision = sum(p.numel() for i, p in params.items() if i in vision_ids)
    language = sum(p.numel() for i, p in params.items() if i not in vision_ids) - added
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    quantized = 0
    if cfg.model.qlora:  # bitsandbytes quantizes every nn.Linear but the head; LoRA's own layers stay fp32
        quantized = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                        and not n.endswith("lm_head") and "lora_" not in n)

    def in_vision(m) -> bool:
        own = [p for p in m.parameters() if id(p) in before]
        return bool(own) and all(id(p) in vision_ids for p in own)

    vision_gated = any(n.endswith(("gate_proj", "gate_up")) and in_vision(m) for n, m in model.named_modules())
    decoder_blocks = [b for b in blocks if not in_vision(b)]
    block_sizes = [sum(p.numel() for p in b.parameters()) for b in decoder_blocks] or [0]
    in_blocks = {id(p) for b in decoder_blocks for p in b.parameters()}
    root = sum(p.numel() for i, p in params.items() if i not in in_blocks)
    has_vision = vision_cfg is not None and vision > 0
    vision_stack = _stack(vision_cfg, vision_gated, ("embed_dim", "hidden_size", "d_model")) if has_vision else None
    return ModelSpec(name, language, vision, trainable, quantized, root, max(block_sizes), vocab,
                     _stack(text_cfg, gated=True), vision_stack)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run's settings the estimate reads (``settings_from(cfg)``)."""
    tokens: int                     # per batch: --max-tokens
    targets: int                    # target tokens of the batch (at most tokens; default: all)
    patches: int = 0                # vision patches of the batch (--max-patches)
    workers: int = 1
    fsdp: bool = False
    checkpointing: bool = False
    bf16: bool = False
    attention: str = "sdpa"         # 'flash' / 'builtin' (no mask), 'sdpa' (T^2 masks), 'eager' (and T^2 scores)
    chunk: int = 1024


def settings_from(cfg, cuda: bool, targets: int | None = None) -> Settings:
    """Settings of a Config, on a CUDA worker (``cuda``) or a CPU one."""
    from ray_mmbatch.models.hf_common import resolve_attn_implementation
    from ray_mmbatch.models.loss import LOSS_CHUNK_TOKENS

    precision = cfg.train.precision
    impl = "builtin" if not cfg.model.path else resolve_attn_implementation(cfg.model.attn_implementation,
                                                                            "cuda" if cuda else "cpu")
    attention = impl if impl == "builtin" else "flash" if "flash" in impl else "eager" if impl == "eager" else "sdpa"
    tokens = int(cfg.budget.max_tokens)
    return Settings(tokens=tokens, targets=min(tokens, targets if targets is not None else tokens),
                    patches=int(cfg.budget.max_patches or 0), workers=max(1, int(cfg.train.num_workers)),
                    fsdp=bool(cfg.train.fsdp), checkpointing=bool(cfg.model.gradient_checkpointing),
                    bf16=precision == "bf16" or (precision == "auto" and cuda), attention=attention,
                    chunk=LOSS_CHUNK_TOKENS)


def layer_bytes_per_token(s: Stack, bf16: bool, kv_repeated: bool = False) -> int:
    """Activations one decoder layer keeps for the backward, per token: the residual and the two norms' fp32
    inputs and normalized values (4d fp32); the norms' outputs as the projections read them, q, k, v, the
    attention output, and the MLP's gate, up, activation and product (a bytes each: 2 bf16, 4 fp32).
    ``kv_repeated``: sdpa with a mask gets k and v repeated to every query head (transformers' repeat_kv)."""
    a = 2 if bf16 else 4
    mlp = 4 * s.intermediate if s.gated else 2 * s.intermediate
    kv = s.hidden if kv_repeated else s.kv_dim
    return 4 * 4 * s.hidden + a * (4 * s.hidden + 2 * kv + mlp)


def vision_bytes_per_patch(s: Stack, bf16: bool) -> int:
    """A vision block per patch: LayerNorm inputs and outputs, q, k, v, attention output (8 dv) and the MLP."""
    a = 2 if bf16 else 4
    return a * (8 * s.hidden + (4 if s.gated else 2) * s.intermediate)


def estimate(spec: ModelSpec, st: Settings) -> list[Item]:
    """The items of the peak per GPU (module docstring); their sum is the estimate."""
    w = st.workers if st.fsdp else 1
    t, d, v = spec.text, spec.text.hidden, spec.vocab
    P, Pt, Pq = spec.total_params, spec.trainable_params, spec.quantized_params
    items = []
    weights = (P - Pq) * 4 + Pq * (0.5 + 0.016)
    text = f"{P:,} params x 4 B" + (f" ({Pq:,} in 4-bit: 0.516 B)" if Pq else "")
    if st.fsdp:
        gathered = (spec.root_params + 2 * spec.block_params) * (2 if st.bf16 else 4)
        weights = weights / w + gathered
        text = f"{P:,} x 4 B / {w} workers + root unit and 2 blocks gathered"
    elif st.bf16:
        weights += Pt * 2
        text += f" + {Pt:,} trainable x 2 B (autocast's bf16 copies)"
    items.append(Item("weights", weights, text))
    items.append(Item("gradients", Pt * 4 / w, f"{Pt:,} trainable x 4 B" + (f" / {w}" if w > 1 else "")))
    items.append(Item("optimizer (AdamW m, v)", Pt * 8 / w, f"{Pt:,} trainable x 8 B" + (f" / {w}" if w > 1 else "")
                      + "; weights are fp32: no master copy"))
    masked = st.attention in ("sdpa", "eager")
    per_layer = layer_bytes_per_token(t, st.bf16, kv_repeated=masked)
    if st.checkpointing:
        acts = st.tokens * (t.layers * 4 * d + per_layer)
        text = f"{st.tokens:,} tokens x ({t.layers} layers x 4 x {d} + one layer's {per_layer:,} B)"
    else:
        acts = st.tokens * t.layers * per_layer
        text = f"{st.tokens:,} tokens x {t.layers} layers x {per_layer:,} B"
    acts += st.tokens * 3 * d * 4
    items.append(Item("activations (language)", acts, text + f" + final norm {3 * 4 * d} B/token"))
    if spec.vision is not None:
        pv, lv, dv = vision_bytes_per_patch(spec.vision, st.bf16), spec.vision.layers, spec.vision.hidden
        if st.checkpointing:
            vis = st.patches * (lv * 4 * dv + pv)
            text = f"{st.patches:,} patches x ({lv} layers x 4 x {dv} + one layer's {pv:,} B)"
        else:
            vis, text = st.patches * lv * pv, f"{st.patches:,} patches x {lv} layers x {pv:,} B"
        items.append(Item("activations (vision)", vis, text if st.patches else
                          "0: no --max-patches, images unbounded (set it to count them)"))
    if masked:  # a packed / padded batch's mask: bool, then per layer sdpa's additive copy
        a = 2 if st.bf16 else 4
        mask = st.tokens ** 2 * (1 + t.layers * a)
        text = f"{st.tokens:,}^2 x (1 B bool + {t.layers} layers x {a} B additive)"
        if st.attention == "eager":
            mask += t.layers * t.heads * st.tokens ** 2 * 2 * a
            text += f" + {t.layers} layers x {t.heads} heads x T^2 x 2 x {a} B (eager scores, probabilities)"
        items.append(Item("attention mask / scores", mask, text))
    c = min(st.chunk, st.targets)
    items.append(Item("logits chunk", 3 * c * v * 4, f"3 x {c:,} targets x {v:,} vocab x 4 B"))
    return items


def total(items: list[Item]) -> float:
    return sum(i.bytes for i in items)


def format_table(items: list[Item], measured: float | None = None) -> str:
    width = max(len(i.name) for i in items)
    lines = [f"{'item':<{width}}  {'GiB':>9}  formula"]
    lines += [f"{i.name:<{width}}  {i.bytes / GiB:>9.3f}  {i.formula}" for i in items]
    lines.append(f"{'total (estimate)':<{width}}  {total(items) / GiB:>9.3f}")
    if measured is not None:
        lines.append(f"{'measured peak':<{width}}  {measured / GiB:>9.3f}  "
                     f"({(total(items) - measured) / max(measured, 1):+.1%} estimate vs measured)")
    return "\n".join(lines)
