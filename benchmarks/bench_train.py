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

    python benchmarks/bench_train.py [--samples 800] [--max-tokens 8192] [--json PATH]

Figures, the exact command and the analysis are in benchmarks/RESULTS.md
("## Training throughput"). Wall time ~4 min on the 2-core dev machine.
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

from ray_mmbatch import schema as S
from ray_mmbatch.batching import collate_pack, collate_pad
from ray_mmbatch.config import BudgetConfig, Config
from ray_mmbatch.data.generate import generate_dataset
from ray_mmbatch.data.measure import materialize_sample
from ray_mmbatch.data.text import load_tokenizer
from ray_mmbatch.models.builtin import build_model, layers
from ray_mmbatch.models.builtin.attention import attend as _ATTEND
from ray_mmbatch.pipeline import plan_rows
from ray_mmbatch.train.step import batch_to_torch, build_optimizer, optimizer_step

from common import read_measured  # noqa: E402  (benchmarks/ is on sys.path when a script runs)

FIXED_BATCH_SIZE = 32
WARMUP_STEPS = 2


# ------------------------------------------------------------------ memory
def _vm(field: str) -> float:
    """A /proc/self/status figure in MiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux clear_refs 5) so each strategy gets its own peak."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


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

    def __init__(self, name: str, batches: list[dict], cfg: Config, tok_size: int, ids: dict,
                 max_tokens: int | None, budget_s: float):
        self.name, self.batches, self.cfg = name, batches, cfg
        self.max_tokens, self.budget_s = max_tokens, budget_s
        self.model = build_model(cfg.model, cfg.image, vocab_size=tok_size, seed=cfg.train.seed, **ids)
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
        }


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
            f"{r['strategy']:<34}{str(r['steps']) + '/' + str(r['planned_steps']):>8}{r['samples']:>8}{r['real_tokens_per_s']:>11.0f}{r['processed_tokens_per_s']:>11.0f}"
            f"{r['fill']:>8.1%}{bfill:>8}{r['train_s']:>9.1f}"
            f"{r['step_s_median']:>8.2f}/{r['step_s_max']:<7.2f}{r['largest_batch']:>12}"
            f"{r['peak_rss_mb']:>8.0f} (+{r['peak_step_rss_growth_mb']:.0f})"
            f"{r['real_tokens_per_s'] / base['real_tokens_per_s']:>8.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="", help="parquet dataset folder (default: generate one in a temp dir)")
    p.add_argument("--samples", type=int, default=800, help="samples to generate when --data is not given")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, default=8192, help="token budget of pack and pad mode")
    p.add_argument("--window", type=int, default=2048, help="planning window (samples)")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--attention", default="sdpa", help="ModelConfig.attention backend")
    p.add_argument("--strategies", default="pack,pad,fixed32",
                   help="comma list of pack, pad, fixed32, pack_tmask (pack on the pre-bucket T x T mask path), "
                        "pad_mask (pad on the explicit [B,1,L,L] mask path)")
    p.add_argument("--budget-s", type=float, default=40.0, help="step-time budget of pack and of pad (s)")
    p.add_argument("--fixed-budget-s", type=float, default=100.0,
                   help="step-time budget of fixed32 (s; its steps take ~30 s, so it needs more for a stable rate)")
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    cfg = Config()
    cfg.model.attention = args.attention
    cfg.train.seed = args.seed
    cfg.budget.max_tokens, cfg.budget.window = args.max_tokens, args.window
    tok = load_tokenizer(cfg.text.tokenizer)
    pad_id = tok.convert_tokens_to_ids(S.PAD_TOKEN)
    ids = {"image_token_id": tok.convert_tokens_to_ids(S.IMAGE_PAD), "pad_id": pad_id}

    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        data_dir = args.data or tmp
        if not args.data:
            generate_dataset(tmp, args.samples, "parquet", seed=args.seed)
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
    plans = {
        "pack": lambda: (f"pack (budget {args.max_tokens})", build_batches(
            planned_groups(measured, samples, cfg.budget, args.seed), samples, "pack", pad_id), args.max_tokens),
        "pad": lambda: (f"pad (budget {args.max_tokens})", build_batches(
            planned_groups(measured, samples, BudgetConfig(**{**vars(cfg.budget), "mode": "pad"}), args.seed),
            samples, "pad", pad_id), args.max_tokens),
        "fixed32": lambda: (f"fixed batch_size={FIXED_BATCH_SIZE}, pad longest", build_batches(
            fixed_groups(samples, FIXED_BATCH_SIZE), samples, "pad", pad_id), None),
    }
    plans["pack_tmask"] = lambda: ("pack, T x T mask (before buckets)", *plans["pack"]()[1:])
    plans["pad_mask"] = lambda: ("pad, [B,1,L,L] mask (before is_causal)", *plans["pad"]()[1:])
    unknown = set(wanted) - set(plans)
    if unknown:
        raise SystemExit(f"unknown strategies {sorted(unknown)}; choose from {sorted(plans)}")
    runs = []
    for key in wanted:
        name, batches, max_tokens = plans[key]()
        budget = args.fixed_budget_s if key == "fixed32" else args.budget_s
        runs.append(StrategyRun(name, batches, cfg, len(tok), ids, max_tokens, budget))
        if key == "pack_tmask":
            runs[-1].attend = attend_block_mask
        if key == "pad_mask":
            runs[-1].attend = attend_pad_mask
    load_before = os.getloadavg()
    results = run_interleaved(runs)
    load_after = os.getloadavg()
    for r in results:
        print(f"  {r['strategy']}: {r['steps']} steps ({r['planned_steps']} planned per pass), {r['samples']} "
              f"samples, fill {r['fill']:.1%} (all planned batches {r['fill_all_planned']:.1%})")
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    base = next((r for r in results if r["strategy"].startswith("fixed")), results[0])
    print(_table(results, base))
    out = {"args": vars(args), "samples": len(samples), "skipped": skipped, "tokens": int(lens.sum()),
           "torch": torch.__version__, "loadavg_before_after": [load_before, load_after], "wall_s": time.perf_counter() - wall, "results": results}
    print(f"wall {out['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
