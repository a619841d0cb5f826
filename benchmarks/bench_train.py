"""Real tokens/s of training: token-budget pack vs pad vs the fixed batch_size=32 default.

Question: on the same data and the same model, how many real (non-padding)
tokens per second does a training step get through when batches are planned by
a token budget, against the usual DataLoader default of 32 samples per batch in
arrival order padded to the longest?

Method (one process, CPU, fp32, ``torch.set_num_threads(2)``, same data and seed for all):

    generate_dataset (parquet, seed) -> parquet_rows -> measure_batch -> fit_batch_to_budget
    -> materialize_sample once per sample (decode, resize, patchify; NOT timed)
    -> batches: pack   plan_rows(window, mode=pack, max_tokens)  -> collate_pack
                pad    plan_rows(window, mode=pad,  max_tokens)  -> collate_pad
                fixed  32 samples in arrival order, no budget    -> collate_pad
    -> per strategy a fresh model (same seed) + AdamW, 2 untimed warm-up steps
       (its two smallest batches), then timed steps = forward + backward + clip +
       optimizer step (train/step.optimizer_step; tensors already built)

Fixed time budget per strategy, with rates: a strategy steps through its
batches in plan order (wrapping into a new pass) until ``--budget-s`` (pack,
pad) or ``--fixed-budget-s`` (fixed32: one step takes ~30 s, so it gets more)
seconds of step time are spent. The strategies are interleaved - the one
furthest behind on its own budget steps next - so all of them run through the
same minutes and share the load other jobs put on the machine. Nothing is
truncated (8192 > longest sample); fill of the trained batches is printed next
to the fill of every planned batch to show the trained part is representative.
Peak RSS: VmHWM reset before each step (Linux clear_refs), max over the steps.
``pack_tmask`` (not in the default list) runs pack through the old full T x T
block-mask attention, and ``pad_mask`` runs pad through the explicit [B,1,L,L]
mask instead of is_causal, for the before/afters of model/attention.py.

Hugging Face backend (``--model DIR`` or ``--model qwen2_vl-tiny``): the same method with the
model ``ray_mmbatch.hf.load_model(DIR)`` (an HFModel; every strategy loads the same weights) and
the data path configured by the checkpoint (``ray_mmbatch.hf.config_from_checkpoint``: Qwen-VL
smart resize with its patch 14 / merge 2 / min-max pixels, its tokenizer and chat template).
``qwen2_vl-tiny`` builds a random Qwen2-VL in a temp dir (``tiny_qwen_checkpoint``:
tests/hf_checkpoints.make_qwen_checkpoint for the tokenizer, template and processor, then the
model widened to text 256 x 4 layers, vision 128 x 2 blocks: 6.19 M parameters, 0.94 M of them
vision; pixel bounds 4..256 merged tokens per image, the built-in default, so the samples match
the built-in run's). ``--attention`` is then the HF attn_implementation (sdpa / eager).
``internvl-tiny`` builds a random InternVL the same way (``tiny_internvl_checkpoint``:
tests/hf_internvl_checkpoint.make_internvl_checkpoint with the same text model as the tiny
Qwen2-VL, a Qwen2 LM 256 x 4 layers, InternViT 128 x 2 layers, 224-px tiles of 64 tokens, up to
6 tiles + thumbnail per image, i.e. 64..448 tokens per image).
``gemma3-tiny`` builds a random Gemma 3 (``tiny_gemma3_checkpoint``: tests/hf_gemma3_checkpoint
with a Gemma 3 text model 256 x 4 layers (head_dim 64; three sliding-window layers of 512
tokens, one global), SigLIP 128 x 2 layers at 224 px in 14-px patches pooled 2 x 2 to 64 tokens
per image, whatever its size; sdpa with explicit per-layer masks in pack mode).
``llava_onevision-tiny`` builds a random LLaVA-OneVision (``tiny_llava_onevision_checkpoint``: the same
Qwen2 LM 256 x 4 layers, SigLIP 128 x 2 layers at 112-px tiles in 14-px patches (64 features per tile),
pinpoints up to 3 x 3 tiles, anyres_max_4: 65 tokens per image of a multi-image sample, 64..376 for a
sample's only image, by its aspect).
``smolvlm-tiny`` builds a random SmolVLM (``tiny_smolvlm_checkpoint``: tests/hf_idefics3_checkpoint
with the same Llama-shaped text model 256 x 4 layers, SigLIP 128 x 2 layers at 128-px views in 16-px
patches pixel-shuffled 2 x 2 to 16 tokens per view; image splitting on, longest edge 512: up to 4 x 4
views + the global view, 16..272 tokens per image plus its row / col text block).
``qwen3_5-tiny`` builds a random Qwen3.5 (``tiny_qwen3_5_checkpoint``: tests/hf_checkpoints.make_qwen3_5_checkpoint
with a text model 256 x 4 layers, three Gated DeltaNet (2 key / 4 value heads of 64) and one gated full-attention
layer (head_dim 64), the tiny test vision tower (32 wide, 2 blocks, 16-px patches), the built-in default's pixel
bounds; pack mode runs its DeltaNet layers per sample, models/deltanet.py).
``qwen3_vl_moe-tiny`` builds a random Qwen3-VL-MoE (``tiny_qwen3_vl_moe_checkpoint``: tests/hf_checkpoints with a
text model 256 x 4 layers (head_dim 64), each MLP 8 experts of 384, top 2, the tiny test vision tower (32 wide, 2
blocks, 16-px patches, deepstack), the built-in default's pixel bounds).
``gemma4-tiny`` builds a random Gemma 4 (``tiny_gemma4_checkpoint``: tests/hf_gemma4_checkpoint with a Gemma 4
text model 256 x 4 layers (head_dim 64; three sliding-window layers of 512 tokens, one full; per-layer inputs of
16; logit softcap 30), its vision tower 128 x 2 layers in 16-px patches pooled 3 x 3, max_soft_tokens 70: the
aspect kept, up to 70 tokens per image, every image padded to 630 patches in the tower; sdpa with explicit
per-layer masks in pack mode).
``mistral3-tiny`` builds a random Mistral 3 (``tiny_mistral3_checkpoint``: tests/hf_mistral3_checkpoint with a
Mistral text model 256 x 4 layers (head_dim 64), a Pixtral tower 128 x 2 layers in 14-px patches merged 2 x 2,
longest edge 224 px: the aspect kept, up to 8 rows of 8 tokens an image plus a break / end token per row).
``glm4v-tiny`` builds a random GLM-4.1V (``tiny_glm4v_checkpoint``: tests/hf_glm4v_checkpoint with a GLM text model
256 x 4 layers (head_dim 64, half rotary, 3-D sections 4 + 6 + 6), the tiny test vision tower (32 wide, 2 blocks,
14-px patches), the built-in default's pixel bounds per frame; pack mode: GLM's get_rope_index per sample).

    python benchmarks/bench_train.py [--samples 800] [--max-tokens 8192] [--json PATH]
    python benchmarks/bench_train.py --model qwen2_vl-tiny --max-tokens 4096 \
        --strategies pack,pack@8192,pad,fixed32 --budget-s 60 --fixed-budget-s 240

``pack@N`` / ``pad@N`` plan the same (already fitted) samples to a larger budget N in the same run.
Figures, the exact commands and the analysis are in benchmarks/RESULTS.md
("## Training throughput"). Wall time ~4 min on the 2-core dev machine; ~12 min with the tiny
Qwen2-VL, whose fixed-32 steps take ~200 s and ~21 GB peak RSS (32 x 3,733 tokens through HF).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import read_measured  # noqa: E402  (benchmarks/ is on sys.path when a script runs)

from ray_mmbatch import schema as S
from ray_mmbatch.batching import collate_pack, collate_pad
from ray_mmbatch.config import BudgetConfig, Config
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.text.tokenizer import load_tokenizer
from ray_mmbatch.dataflow.stages import plan_rows
from ray_mmbatch.models.builtin import build_model, layers
from ray_mmbatch.models.builtin.attention import attend as _ATTEND
from ray_mmbatch.synthetic.generate import generate_dataset
from ray_mmbatch.train.peak import reset_peak_rss
from ray_mmbatch.train.step import batch_to_torch, build_optimizer, optimizer_step

FIXED_BATCH_SIZE = 32
WARMUP_STEPS = 2
TINY_QWEN = "qwen2_vl-tiny"
TINY_INTERNVL = "internvl-tiny"
TINY_GEMMA3 = "gemma3-tiny"
TINY_ONEVISION = "llava_onevision-tiny"
# the tiny Qwen2-VL's shape: wide enough that a CPU step is dominated by the model, not Python
TINY_TEXT = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "max_position_embeddings": 32768}
TINY_MROPE = [8, 12, 12]  # (t, h, w) rotary sections: sum = head_dim / 2 = 32
TINY_VISION = {"depth": 2, "embed_dim": 128, "num_heads": 4, "mlp_ratio": 4, "hidden_size": 256}


# ------------------------------------------------------------------ memory
def _vm(field: str) -> float:
    """A /proc/self/status figure in MiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


# ------------------------------------------------------------------ models
def tests_on_path() -> None:
    """The tiny checkpoints are built by the tests' makers (tests/hf_*checkpoint.py): the repo root on sys.path."""
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if root not in sys.path:
        sys.path.insert(0, root)


def tiny_qwen_checkpoint(directory: str, seed: int = 0) -> str:
    """A random Qwen2-VL checkpoint dir (module header): the test builder's tokenizer, chat template
    and image processor (pixel bounds = the built-in default's), then config + weights widened."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    tests_on_path()
    from tests.hf_checkpoints import make_qwen_checkpoint

    image = Config().image
    make_qwen_checkpoint(directory, "qwen2_vl", initializer_range=0.02, seed=seed, image_processor={
        "size": {"shortest_edge": image.min_pixels, "longest_edge": image.max_pixels}})
    config_cls = type(AutoConfig.from_pretrained(directory))
    config = config_cls.from_pretrained(directory).to_dict()
    config["text_config"].pop("layer_types", None)  # re-derived for the new layer count
    config["text_config"].update(TINY_TEXT)
    config["text_config"]["rope_parameters"]["mrope_section"] = TINY_MROPE
    config["vision_config"].update(TINY_VISION)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config_cls.from_dict(config)).save_pretrained(directory)
    return directory


def tiny_internvl_checkpoint(directory: str, seed: int = 0) -> str:
    """A random InternVL checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_internvl_checkpoint import make_internvl_checkpoint

    make_internvl_checkpoint(directory, initializer_range=0.02, seed=seed, tile=224, max_patches=6,
                             text=TINY_TEXT, vision={"hidden_size": 128, "intermediate_size": 512,
                                                     "num_hidden_layers": 2, "num_attention_heads": 4})
    return directory


def tiny_gemma3_checkpoint(directory: str, seed: int = 0) -> str:
    """A random Gemma 3 checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_gemma3_checkpoint import make_gemma3_checkpoint

    text = {**TINY_TEXT, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512,
            "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    make_gemma3_checkpoint(directory, initializer_range=0.02, seed=seed, image_size=224, patch=14, tokens_per_image=64,
                           text=text, vision={"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
                                              "num_attention_heads": 4})
    return directory


def tiny_llava_onevision_checkpoint(directory: str, seed: int = 0) -> str:
    """A random LLaVA-OneVision checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_llava_onevision_checkpoint import make_llava_onevision_checkpoint

    make_llava_onevision_checkpoint(directory, initializer_range=0.02, seed=seed, tile=112, anyres_max=4, grid_most=3,
                                    text=TINY_TEXT, vision={"hidden_size": 128, "intermediate_size": 512,
                                                            "num_hidden_layers": 2, "num_attention_heads": 4})
    return directory


TINY_CHECKPOINTS = {TINY_QWEN: tiny_qwen_checkpoint, TINY_INTERNVL: tiny_internvl_checkpoint,
                    TINY_GEMMA3: tiny_gemma3_checkpoint, TINY_ONEVISION: tiny_llava_onevision_checkpoint}


TINY_SMOLVLM = "smolvlm-tiny"


def tiny_smolvlm_checkpoint(directory: str, seed: int = 0) -> str:
    """A random SmolVLM checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_idefics3_checkpoint import make_idefics3_checkpoint

    make_idefics3_checkpoint(directory, "smolvlm", initializer_range=0.02, seed=seed, side=128, patch=16, tiles=4,
                             splitting=True, text=TINY_TEXT, vision={"hidden_size": 128, "intermediate_size": 512,
                                                                "num_hidden_layers": 2, "num_attention_heads": 4})
    return directory


TINY_CHECKPOINTS[TINY_SMOLVLM] = tiny_smolvlm_checkpoint


TINY_QWEN3_5 = "qwen3_5-tiny"


def tiny_qwen3_5_checkpoint(directory: str, seed: int = 0) -> str:
    """A random Qwen3.5 checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_checkpoints import make_qwen3_5_checkpoint

    image = Config().image
    text = {**TINY_TEXT, "head_dim": 64, "linear_key_head_dim": 64, "linear_value_head_dim": 64,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    make_qwen3_5_checkpoint(directory, initializer_range=0.02, seed=seed, text=text, image_processor={
        "size": {"shortest_edge": image.min_pixels, "longest_edge": image.max_pixels}})
    return directory


TINY_CHECKPOINTS[TINY_QWEN3_5] = tiny_qwen3_5_checkpoint


TINY_QWEN3_VL_MOE = "qwen3_vl_moe-tiny"


def tiny_qwen3_vl_moe_checkpoint(directory: str, seed: int = 0) -> str:
    """A random Qwen3-VL-MoE checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_checkpoints import make_qwen_checkpoint

    image = Config().image
    text = {**TINY_TEXT, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 384,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [12, 10, 10],
                                "mrope_interleaved": True}}
    make_qwen_checkpoint(directory, "qwen3_vl_moe", initializer_range=0.02, seed=seed, text=text, image_processor={
        "size": {"shortest_edge": image.min_pixels, "longest_edge": image.max_pixels}})
    return directory


TINY_CHECKPOINTS[TINY_QWEN3_VL_MOE] = tiny_qwen3_vl_moe_checkpoint


TINY_GEMMA4 = "gemma4-tiny"


def tiny_gemma4_checkpoint(directory: str, seed: int = 0) -> str:
    """A random Gemma 4 checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_gemma4_checkpoint import make_gemma4_checkpoint

    text = {**TINY_TEXT, "head_dim": 64, "global_head_dim": 64, "sliding_window": 512, "num_kv_shared_layers": 0,
            "hidden_size_per_layer_input": 16, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    make_gemma4_checkpoint(directory, initializer_range=0.02, seed=seed, text=text,
                           vision={"hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2,
                                   "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 32,
                                   "patch_size": 16, "position_embedding_size": 1024},
                           image_processor={"patch_size": 16})
    return directory


TINY_CHECKPOINTS[TINY_GEMMA4] = tiny_gemma4_checkpoint


TINY_MISTRAL3 = "mistral3-tiny"


def tiny_mistral3_checkpoint(directory: str, seed: int = 0) -> str:
    """A random Mistral 3 checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_mistral3_checkpoint import make_mistral3_checkpoint

    make_mistral3_checkpoint(directory, initializer_range=0.02, seed=seed, text_override={**TINY_TEXT, "head_dim": 64},
                             vision={"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4,
                                     "head_dim": 32}, patch=14, longest=224)
    return directory


TINY_CHECKPOINTS[TINY_MISTRAL3] = tiny_mistral3_checkpoint
TINY_GLM4V = "glm4v-tiny"


def tiny_glm4v_checkpoint(directory: str, seed: int = 0) -> str:
    """A random GLM-4.1V checkpoint dir (module header), built by the test builder at the benchmark's width."""
    tests_on_path()
    from tests.hf_glm4v_checkpoint import make_glm4v_checkpoint

    image = Config().image  # GLM counts a still image's area over its 2 frames: twice the per-frame bounds
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [4, 6, 6]}
    make_glm4v_checkpoint(directory, initializer_range=0.02, seed=seed, text={**TINY_TEXT, "rope_parameters": rope},
                          image_processor={"size": {"shortest_edge": 2 * image.min_pixels,
                                                    "longest_edge": 2 * image.max_pixels}})
    return directory


TINY_CHECKPOINTS[TINY_GLM4V] = tiny_glm4v_checkpoint


def model_setup(args, tmp: str) -> tuple[Config, object, dict, object, str]:
    """(cfg, tokenizer, token ids, make_model() -> fresh model, description) for --model."""
    from ray_mmbatch.run.defaults import resolve_defaults

    cfg = resolve_defaults(Config())  # the demo's lr and warm-up for every model, as the recorded figures used
    cfg.train.seed = args.seed
    cfg.budget.max_tokens, cfg.budget.window = args.max_tokens, args.window
    if not args.model:
        cfg.model.attention = args.attention
        tok = load_tokenizer(cfg.text.tokenizer)
        ids = {"image_token_id": tok.convert_tokens_to_ids(S.IMAGE_PAD),
               "pad_id": tok.convert_tokens_to_ids(S.PAD_TOKEN)}
        return cfg, tok, ids, lambda: build_model(cfg.model, cfg.image, vocab_size=len(tok), seed=args.seed, **ids), \
            f"built-in, attention {args.attention}"
    from ray_mmbatch.hf import config_from_checkpoint, load_model
    from ray_mmbatch.models import token_ids

    build = TINY_CHECKPOINTS.get(args.model)
    path = build(os.path.join(tmp, "model"), args.seed) if build else args.model
    cfg.model.attn_implementation = args.attention
    config_from_checkpoint(path, cfg)
    return cfg, load_tokenizer(cfg.text.tokenizer), token_ids(cfg), lambda: load_model(path, cfg), \
        f"{args.model} (HF {cfg.model.attn_implementation})"


# ------------------------------------------------------------------ data
def materialize_all(measured: dict, cfg: Config) -> tuple[dict[str, dict], list[tuple[str, str]]]:
    """sample_id -> materialized sample (arrival order kept), and [(id, reason)] of every skipped one."""
    from ray_mmbatch.data.image import ImageSkip

    samples, skipped = {}, []
    n = len(measured[S.SAMPLE_ID])
    for i in range(n):
        row = {k: v[i] for k, v in measured.items()}
        sid = str(row[S.SAMPLE_ID])
        if row[S.SKIP_REASON]:
            skipped.append((sid, str(row[S.SKIP_REASON])))
            continue
        try:
            samples[sid] = materialize_sample(row, cfg.image)
        except ImageSkip as e:
            skipped.append((sid, f"{e.reason}: {e}"))
    return samples, skipped


def planned_groups(measured: dict, samples: dict, budget: BudgetConfig, seed: int) -> list[list[str]]:
    """Sample-id groups from the pipeline's own planner, one window of ``budget.window`` rows at a time."""
    keep = np.array([str(s) in samples for s in measured[S.SAMPLE_ID]])
    rows = {k: np.asarray(v, dtype=object)[keep] if not isinstance(v, np.ndarray) else v[keep]
            for k, v in measured.items()}
    n, groups = int(keep.sum()), []
    for start in range(0, n, budget.window):
        window = {k: v[start:start + budget.window] for k, v in rows.items()}
        groups += [list(g) for g in plan_rows(window, budget, seed, 0)[S.BATCH_SAMPLE_IDS] if len(g)]
    return groups


def fixed_groups(samples: dict, size: int) -> list[list[str]]:
    """The DataLoader default: ``size`` samples per batch in arrival order, nothing dropped."""
    ids = list(samples)
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def build_batches(groups: list[list[str]], samples: dict, mode: str, pad_id: int) -> list[dict]:
    collate = collate_pack if mode == "pack" else collate_pad
    return [batch_to_torch(collate([samples[s] for s in g], pad_id), "cpu") for g in groups]


# ------------------------------------------------------------------ training
def attend_block_mask(q, k, v, layout):
    """The sdpa pack path before length buckets: one call over the full T x T block mask (for before/after)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.sdpa_mask())


def attend_pad_mask(q, k, v, layout):
    """The sdpa pad path before is_causal: the explicit [B, 1, L, L] mask (for before/after)."""
    if layout.packed:  # the vision tower: unchanged
        return _ATTEND(q, k, v, layout)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.sdpa_mask())


class StrategyRun:
    """One strategy's model, optimizer, batches and per-step measurements."""

    def __init__(self, name: str, batches: list[dict], cfg: Config, make_model, max_tokens: int | None,
                 budget_s: float, trainable: str = ""):
        self.name, self.batches, self.cfg = name, batches, cfg
        self.max_tokens, self.budget_s = max_tokens, budget_s
        self.model = make_model()
        self.trainable = apply_trainable(self.model, cfg, trainable)
        self.opt, self.sched = build_optimizer(self.model, cfg.train, 10 * len(batches))
        self.step_s, self.trained, self.losses, self.peak_rss, self.step_rss = [], [], [], 0.0, 0.0
        self.attend = None   # set for pack_tmask: the model's attention function for this run only

    def warm_up(self) -> None:
        """Two untimed steps on the two smallest batches: first-call costs, not batch size."""
        for b in sorted(self.batches, key=lambda b: b["input_ids"].numel())[:WARMUP_STEPS]:
            self._optimizer_step(b)

    def _optimizer_step(self, b: dict) -> dict:
        saved = layers.attend
        layers.attend = self.attend or saved
        try:
            return optimizer_step(self.model, [b], self.opt, self.sched, self.cfg.train, "cpu")
        finally:
            layers.attend = saved

    @property
    def share_used(self) -> float:
        return sum(self.step_s) / self.budget_s

    def step(self) -> None:
        """Next batch in plan order (wrapping to a new pass), timed by optimizer_step."""
        b = self.batches[len(self.step_s) % len(self.batches)]
        rss_before = _vm("VmRSS")
        reset_peak_rss()
        m = self._optimizer_step(b)
        peak = _vm("VmHWM")
        self.peak_rss, self.step_rss = max(self.peak_rss, peak), max(self.step_rss, peak - rss_before)
        self.step_s.append(m["time_s"])
        self.trained.append(b)
        self.losses.append(m["loss"])

    def result(self) -> dict:
        real = sum(int(b["real_tokens"]) for b in self.trained)
        processed = sum(int(b["input_ids"].numel()) for b in self.trained)
        planned_real = sum(int(b["real_tokens"]) for b in self.batches)
        planned = sum(int(b["input_ids"].numel()) for b in self.batches)
        shape = max((tuple(b["input_ids"].shape) for b in self.trained), key=lambda s: s[0] * s[1])
        train_s = float(sum(self.step_s))
        return {
            "strategy": self.name, "steps": len(self.step_s), "planned_steps": len(self.batches),
            "samples": sum(len(b["sample_ids"]) for b in self.trained), "real_tokens": real,
            "processed_tokens": processed, "train_s": train_s,
            "real_tokens_per_s": real / train_s, "processed_tokens_per_s": processed / train_s,
            "fill": real / processed, "fill_all_planned": planned_real / planned,
            "budget_fill": real / (len(self.step_s) * self.max_tokens) if self.max_tokens else None,
            "step_s_median": float(np.median(self.step_s)), "step_s_max": float(max(self.step_s)),
            "largest_batch": f"{shape[0]}x{shape[1]}", "largest_batch_tokens": shape[0] * shape[1],
            "peak_rss_mb": self.peak_rss, "peak_step_rss_growth_mb": self.step_rss,
            "final_loss": float(np.mean(self.losses[-5:])),
            **self.trainable,
        }


TRAINABLE = {"full": {}, "lora": {"lora_rank": 8, "lora_alpha": 16.0}, "freeze_vision": {"freeze": "vision"}}


def apply_trainable(model, cfg: Config, which: str) -> dict:
    """``+lora`` / ``+freeze_vision`` (models/trainable.py) on a fresh model; its parameter counts and the
    sizes of: the full state dict, what a training checkpoint holds of it (train/checkpoint.py
    ``checkpoint_weights``: the trainable weights and buffers) and, for LoRA, the exported adapter."""
    import copy
    import io

    from ray_mmbatch.models.trainable import configure_trainable, lora_state_dict
    from ray_mmbatch.train.checkpoint import checkpoint_weights

    if which not in TRAINABLE:
        raise SystemExit(f"unknown trainable setting {which!r}; choose from {sorted(TRAINABLE)}")
    c = copy.deepcopy(cfg)
    for k, v in TRAINABLE[which].items():
        setattr(c.model, k, v)
    counts = configure_trainable(model, c)

    def mb(sd: dict) -> float:
        buf = io.BytesIO()
        torch.save(sd, buf)
        return buf.tell() / 2**20

    out = {"trainable": which, **counts, "full_mb": mb(model.state_dict()),
           "checkpoint_mb": mb(checkpoint_weights(model))}
    if which == "lora":
        out["adapter_mb"] = mb(lora_state_dict(model))
    return out


def run_interleaved(runs: list[StrategyRun]) -> list[dict]:
    """Always step the strategy furthest behind on its own time budget, so every strategy spends its
    budget across the same stretch of wall time and shares whatever load other jobs put on the box."""
    for run in runs:
        run.warm_up()
    active = list(runs)
    while active:
        run = min(active, key=lambda r: r.share_used)
        run.step()
        active = [r for r in active if r.share_used < 1.0]
    return [r.result() for r in runs]


def _table(results: list[dict], base: dict) -> str:
    head = (f"{'strategy':<34}{'steps':>8}{'samples':>8}{'real tok/s':>11}{'proc tok/s':>11}{'fill':>8}{'bfill':>8}"
            f"{'train s':>9}{'step med/max s':>16}{'largest':>12}{'peak RSS MB':>13}{'vs fixed':>9}")
    lines = [head]
    for r in results:
        bfill = f"{r['budget_fill']:.1%}" if r["budget_fill"] is not None else "-"
        lines.append(
            f"{r['strategy']:<34}{str(r['steps']) + '/' + str(r['planned_steps']):>8}{r['samples']:>8}"
            f"{r['real_tokens_per_s']:>11.0f}{r['processed_tokens_per_s']:>11.0f}"
            f"{r['fill']:>8.1%}{bfill:>8}{r['train_s']:>9.1f}"
            f"{r['step_s_median']:>8.2f}/{r['step_s_max']:<7.2f}{r['largest_batch']:>12}"
            f"{r['peak_rss_mb']:>8.0f} (+{r['peak_step_rss_growth_mb']:.0f})"
            f"{r['real_tokens_per_s'] / base['real_tokens_per_s']:>8.2f}x")
    if any(r.get("trainable", "full") != "full" for r in results):  # +lora / +freeze_vision runs
        lines.append(f"{'what trains':<34}{'trainable':>12}{'total':>12}{'full MB':>9}{'checkpoint MB':>15}"
                     f"{'adapter MB':>12}")
        for r in results:
            adapter = f"{r['adapter_mb']:.2f}" if "adapter_mb" in r else "-"
            lines.append(f"{r['strategy']:<34}{r['trainable_params']:>12,}{r['total_params']:>12,}"
                         f"{r['full_mb']:>9.2f}{r['checkpoint_mb']:>15.2f}{adapter:>12}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="", help="parquet dataset folder (default: generate one in a temp dir)")
    p.add_argument("--samples", type=int, default=800, help="samples to generate when --data is not given")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8192, help="token budget of pack and pad mode")
    p.add_argument("--window", type=int, default=2048, help="planning window (samples)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--model", default="", help=f"HF checkpoint dir, or one of {' / '.join(TINY_CHECKPOINTS)} (a "
                   "random tiny model of that family built in a temp dir, see the module header); default: the "
                   "built-in model")
    p.add_argument("--attention", default="sdpa",
                   help="ModelConfig.attention (built-in) or ModelConfig.attn_implementation (--model: sdpa, eager)")
    p.add_argument("--strategies", default="pack,pad,fixed32",
                   help="comma list of pack, pad, fixed32, pack@N / pad@N (budget N >= --max-tokens, same samples), "
                        "pack_tmask (pack on the pre-bucket T x T mask path), pad_mask (pad on the explicit "
                        "[B,1,L,L] mask path); a suffix +lora / +freeze_vision / +full sets what trains "
                        "(pack+lora: LoRA r=8 on the language model's linear layers; +freeze_vision: --freeze vision)")
    p.add_argument("--budget-s", type=float, default=40.0, help="step-time budget of pack and of pad (s)")
    p.add_argument("--fixed-budget-s", type=float, default=100.0,
                   help="step-time budget of fixed32 (s; its steps take ~30 s, so it needs more for a stable rate)")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        out = run_benchmark(args, tmp, wall)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


def run_benchmark(args, tmp: str, wall: float) -> dict:
    cfg, tok, ids, make_model, model_desc = model_setup(args, tmp)
    pad_id = ids["pad_id"]
    data_dir = args.data or os.path.join(tmp, "data")
    if not args.data:
        generate_dataset(data_dir, args.samples, "parquet", seed=args.seed)
    t0 = time.perf_counter()
    measured = read_measured(data_dir, cfg, tok, cfg.budget)
    samples, skipped = materialize_all(measured, cfg)
    prep_s = time.perf_counter() - t0
    lens = np.array([len(s["input_ids"]) for s in samples.values()])
    print(f"{len(samples)} samples ({len(skipped)} skipped), {lens.sum()} tokens, mean {lens.mean():.0f}, "
          f"max {lens.max()}; measure+materialize {prep_s:.1f} s (not timed)")
    for sid, reason in skipped:
        print(f"  skipped {sid}: {reason}")

    wanted = args.strategies.split(",")

    def budget_plan(mode: str, max_tokens: int):
        if max_tokens < args.max_tokens:
            raise SystemExit(f"{mode}@{max_tokens}: below --max-tokens {args.max_tokens}, which the samples were "
                             "fitted to; give the smaller budget as --max-tokens")
        budget = BudgetConfig(**{**vars(cfg.budget), "mode": mode, "max_tokens": max_tokens})
        return (f"{mode} (budget {max_tokens})",
                build_batches(planned_groups(measured, samples, budget, args.seed), samples, mode, pad_id), max_tokens)

    plans = {
        "pack": lambda: budget_plan("pack", args.max_tokens),
        "pad": lambda: budget_plan("pad", args.max_tokens),
        "fixed32": lambda: (f"fixed batch_size={FIXED_BATCH_SIZE}, pad longest", build_batches(
            fixed_groups(samples, FIXED_BATCH_SIZE), samples, "pad", pad_id), None),
    }
    plans["pack_tmask"] = lambda: ("pack, T x T mask (before buckets)", *plans["pack"]()[1:])
    plans["pad_mask"] = lambda: ("pad, [B,1,L,L] mask (before is_causal)", *plans["pad"]()[1:])
    for key in wanted:  # pack@N / pad@N: the same samples planned to a larger budget N, in the same run
        base_key, _, train = key.partition("+")  # pack+lora, pad+freeze_vision: what trains (models/trainable.py)
        if train and base_key in plans:
            plans[key] = lambda base_key=base_key, train=train: (f"{plans[base_key]()[0]} [{train}]",
                                                                 *plans[base_key]()[1:])
            continue
        mode, _, n = key.partition("@")
        if mode in ("pack", "pad") and n.isdigit():
            plans[key] = lambda mode=mode, n=int(n): budget_plan(mode, n)
    unknown = set(wanted) - set(plans)
    if unknown:
        raise SystemExit(f"unknown strategies {sorted(unknown)}; choose from {sorted(plans)} or pack@N / pad@N")
    if args.model and {"pack_tmask", "pad_mask"} & set(wanted):
        raise SystemExit("pack_tmask / pad_mask swap the built-in model's attention; not with --model")
    runs = []
    for key in wanted:
        name, batches, max_tokens = plans[key]()
        budget = args.fixed_budget_s if key == "fixed32" else args.budget_s
        runs.append(StrategyRun(name, batches, cfg, make_model, max_tokens, budget,
                                key.partition("+")[2] or "full"))
        if key == "pack_tmask":
            runs[-1].attend = attend_block_mask
        if key == "pad_mask":
            runs[-1].attend = attend_pad_mask
    params = sum(p.numel() for p in runs[0].model.parameters())
    print(f"model {model_desc}: {params / 1e6:.2f} M parameters; fp32, {args.threads} torch threads")
    load_before = os.getloadavg()
    results = run_interleaved(runs)
    load_after = os.getloadavg()
    for r in results:
        print(f"  {r['strategy']}: {r['steps']} steps ({r['planned_steps']} planned per pass), {r['samples']} "
              f"samples, fill {r['fill']:.1%} (all planned batches {r['fill_all_planned']:.1%})")
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    base = next((r for r in results if r["strategy"].startswith("fixed")), results[0])
    print(_table(results, base))
    out = {"args": vars(args), "model": model_desc, "params": params, "samples": len(samples), "skipped": skipped,
           "tokens": int(lens.sum()), "max_sample_tokens": int(lens.max()), "torch": torch.__version__,
           "loadavg_before_after": [load_before, load_after], "wall_s": time.perf_counter() - wall, "results": results}
    print(f"wall {out['wall_s']:.0f} s")
    return out


if __name__ == "__main__":
    main()
