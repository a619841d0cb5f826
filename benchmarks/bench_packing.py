"""How much compute does each batching strategy waste? (planner fill and speed)

Realistic cost mixture of an image-text SFT set (seeded, lognormal draws; image
tokens are counted after a 2x2 merge, patches = 4 * image tokens):

    share  kind            text tokens              images / image tokens each
    35%    caption         ~18   (5..60)            1 x 64..256
    25%    conversation    ~900  (300..4000)        1 x 64..256
    10%    hi-res document ~150  (50..500)          1 x 1000..4000
    20%    text only       ~300  (50..2000)         0
    10%    multi-image     ~250  (50..800)          2..6 x 64..256

At max_tokens=16384 it reports, per strategy: fill (real tokens / compute
occupied), budget_fill (real / batches*max_tokens), batches vs the lower bound
ceil(sum tokens / max_tokens) (LB) and vs the sum over windows of each window's
own bound (LB_win: the floor for planning windows independently), largest batch
vs the budget, tokens truncated:
  (a) fixed batch_size=32 padded to the longest (DataLoader default)
  (b) every sample padded / truncated to 512 tokens, 4 per batch
  (c) greedy token budget in arrival order (pack and pad)
  (d) our planners, pad and pack mode, windows 512 / 2048 / 8192, each window
      planned on its own (the pipeline with budget.carry = 0)
  (e) the same planners with carry (batching/carry.py, the pipeline default):
      under-filled batches held back into the next window, capped at a fraction
      of the window; reports the samples held after each window (mean / max)
      and the most windows any sample waited
  (f) planner speed, samples/s on one core (window 2048), with and without carry
  (g) multi-budget speed: pack_best_fit_decreasing with max_patches = 2 * max_tokens
      (the patch budget binds), at 4,096 and 16,384 tokens, window 2048, with and without
      carry (samples that cannot fit alone at 4,096 are left out of that run)
  (h) the patch budget binding on nearly every sample: a Qwen2-VL-like mixture
      (below), max_patches = 2 * max_tokens at 4,096 and 16,384 tokens, window 2048;
      pack_best_fit_decreasing's speed with the token budget alone and with the patch
      budget on the same windows in the same run (alternating) and their ratio; fill
      (tokens, and patches: sum / (batches * max_patches)) and batches against the token
      bound ceil(sum tokens / max_tokens), the patch bound ceil(sum patches / max_patches)
      and LB_win (per window, the larger of the two), planned window by window and with carry

Qwen2-VL-like mixture for (h) (image tokens after the 2x2 merge, patches = 4 x image
tokens, so a sample is patch-bound at max_patches = 2 * max_tokens when its image
tokens exceed its text):

    share  kind            text tokens              images / image tokens each
    60%    single image    ~80   (5..1500)          1 x ~600 (64..1280)
    20%    multi-image     ~200  (20..2000)         2..4: ~600 + ~300 (64..1000) each more
    15%    document        ~60   (5..600)           1 x ~1200 (400..1800)
     5%    text only       ~400  (50..3000)         0

  (i) ``--operator-rows N`` (instead of a-h): ray_mmbatch.batch_by_token_budget on a plain
      Ray Dataset of N text rows (id, input_ids) against ds.iter_batches(batch_size=32)
      padded to the longest, with and without carry: benchmarks/bench_operator.py run as
      ``--rows N --text --carry 0.1`` (flags after ``--`` go to it). Ray 2.60 has no length
      bucketing of its own to compare with (ray-project/ray#66053 is an open PR).

    python benchmarks/bench_packing.py [--n 65536] [--json PATH]
    python benchmarks/bench_packing.py --operator-rows 1000000 [-- --blocks 100]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from ray_mmbatch.batching import ALGORITHMS, Budget, plan_batches_arrays, plan_stats_arrays
from ray_mmbatch.batching.carry import CarryPlanner, resolve_carry

MAX_TOKENS = 16384


def _lognormal(rng, n, median, lo, hi, sigma=0.6):
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), lo, hi).astype(np.int64)


def realistic_costs(n: int, seed: int = 0):
    """Arrays (tokens, patches, images) drawn from the mixture in the header."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(5, size=n, p=[0.35, 0.25, 0.10, 0.20, 0.10])
    text = np.select([kind == 0, kind == 1, kind == 2, kind == 3, kind == 4], [
        _lognormal(rng, n, 18, 5, 60), _lognormal(rng, n, 900, 300, 4000, 0.8),
        _lognormal(rng, n, 150, 50, 500), _lognormal(rng, n, 300, 50, 2000, 0.9),
        _lognormal(rng, n, 250, 50, 800)])
    images = np.select([kind == 3, kind == 4], [0, rng.integers(2, 7, n)], 1).astype(np.int64)
    small = lambda: _lognormal(rng, n, 128, 64, 256, 0.4)  # noqa: E731
    img_tokens = np.where(kind == 2, _lognormal(rng, n, 2000, 1000, 4000, 0.4), small())
    extra = sum(np.where(images > k, small(), 0) for k in range(1, 6))
    img_tokens = np.where(images > 0, img_tokens + extra, 0)
    return text + img_tokens, 4 * img_tokens, images


def qwen_vl_costs(n: int, seed: int = 0):
    """Arrays (tokens, patches, images) of the image-heavy mixture (h) in the header."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(4, size=n, p=[0.60, 0.20, 0.15, 0.05])
    text = np.select([kind == 0, kind == 1, kind == 2, kind == 3], [
        _lognormal(rng, n, 80, 5, 1500, 0.9), _lognormal(rng, n, 200, 20, 2000, 0.8),
        _lognormal(rng, n, 60, 5, 600, 0.8), _lognormal(rng, n, 400, 50, 3000, 0.9)])
    images = np.select([kind == 1, kind == 3], [rng.integers(2, 5, n), 0], 1).astype(np.int64)
    first = np.where(kind == 2, _lognormal(rng, n, 1200, 400, 1800, 0.4),
                     _lognormal(rng, n, 600, 64, 1280, 0.6))
    extra = sum(np.where(images > k, _lognormal(rng, n, 300, 64, 1000, 0.5), 0) for k in range(1, 4))
    img_tokens = np.where(images > 0, first + extra, 0)
    return text + img_tokens, 4 * img_tokens, images


def _row(name, st, truncated=0, speed=None):
    return {"strategy": name, "fill": st["fill"], "budget_fill": st["budget_fill"],
            "n_batches": st["n_batches"], "lower_bound": st["lower_bound_batches"],
            "largest_vs_budget": st["max_batch_cost_ratio"], "truncated_tokens": int(truncated),
            "window_lower_bound": st.get("window_lower_bound"), "samples_per_s": speed,
            "carry": st.get("carry")}


def _fixed_rows(tokens, rows, width=None):
    """Baselines (a)/(b): fixed rows per batch, padded to the longest or to ``width``."""
    n = len(tokens)
    nb = math.ceil(n / rows)
    kept = np.minimum(tokens, width) if width else tokens
    real = int(kept.sum())
    longest = np.array([kept[i:i + rows].max() for i in range(0, n, rows)])
    occupied = int(sum(min(rows, n - i) for i in range(0, n, rows)) * (width or 1)) if width \
        else int(sum(min(rows, n - k * rows) * L for k, L in enumerate(longest)))
    worst = (rows * (width or longest.max())) / MAX_TOKENS
    return {"fill": real / occupied, "budget_fill": real / (nb * MAX_TOKENS), "n_batches": nb,
            "lower_bound_batches": math.ceil(int(tokens.sum()) / MAX_TOKENS),
            "max_batch_cost_ratio": worst}, int((tokens - kept).sum())


def _windowed(tokens, patches, images, budget, window, algorithm):
    """Plan each window on its own; return merged stats (lower bound over the whole set)."""
    batches, window_lb = [], 0
    for s in range(0, len(tokens), window):
        sl = slice(s, s + window)
        part = plan_batches_arrays(tokens[sl], patches[sl], images[sl], budget, seed=s,
                                   algorithm=algorithm)
        batches += [[s + i for i in b] for b in part]
        window_lb += math.ceil(int(tokens[sl].sum()) / budget.max_tokens)
    st = plan_stats_arrays(tokens, patches, images, batches, budget)
    st["window_lower_bound"] = window_lb  # no planner of independent windows can go below
    return st


def _carried(tokens, patches, images, budget, window, algorithm, carry=None):
    """Plan the stream with CarryPlanner exactly as the pipeline's plan stage does."""
    planner = CarryPlanner(budget, algorithm, carry)
    batches, held, waited = [], [], {}
    for s in range(0, len(tokens), window):
        sl = slice(s, s + window)
        batches += planner.feed(list(range(s, min(s + window, len(tokens)))), tokens[sl],
                                patches[sl], images[sl], seed=s)
        held.append(len(planner.held))
        for i in planner.held:
            waited[i] = waited.get(i, 0) + 1
    batches += planner.flush(seed=len(tokens))
    st = plan_stats_arrays(tokens, patches, images, batches, budget)
    assert st["n_samples"] == len(tokens) == len({i for b in batches for i in b}), "lossless"
    st["carry"] = {"cap": resolve_carry(budget.mode, carry), "held_mean": float(np.mean(held)),
                   "held_max": int(max(held)), "max_windows_waited": max(waited.values(), default=0)}
    return st


def _speed(tokens, patches, images, budget, algorithm, window=2048, min_s=1.0, carry=False):
    done, t0, s = 0, time.perf_counter(), 0
    planner = CarryPlanner(budget, algorithm) if carry else None
    while time.perf_counter() - t0 < min_s:
        sl = slice(s, s + window)
        if planner is not None:
            planner.feed(range(sl.start, sl.start + len(tokens[sl])), tokens[sl], patches[sl],
                         images[sl], seed=0)
        else:
            plan_batches_arrays(tokens[sl], patches[sl], images[sl], budget, seed=0,
                                algorithm=algorithm)
        done += len(tokens[sl])
        s = (s + window) % (len(tokens) - window)
    return done / (time.perf_counter() - t0)


def _speed_pair(tokens, patches, images, budgets, algorithm, window=2048, min_s=1.0, rounds=4):
    """samples/s of each budget on the same windows, alternating in ``rounds`` slices so
    that load from other processes hits both alike (their ratio is the figure to trust)."""
    done, spent, starts = [0] * len(budgets), [0.0] * len(budgets), [0] * len(budgets)
    for _ in range(rounds):
        for k, b in enumerate(budgets):
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < min_s / rounds:
                s = starts[k]
                plan_batches_arrays(tokens[s:s + window], patches[s:s + window], images[s:s + window],
                                    b, seed=0, algorithm=algorithm)
                done[k] += len(tokens[s:s + window])
                starts[k] = (s + window) % (len(tokens) - window)
            spent[k] += time.perf_counter() - t0
    return [d / t for d, t in zip(done, spent)]


def _patch_bound(n, seed, min_s):
    """(h): the Qwen2-VL-like mixture, max_patches = 2 * max_tokens (see the header)."""
    tokens, patches, images = qwen_vl_costs(n, seed)
    algo, out = "pack_best_fit_decreasing", []
    for mt in (4096, 16384):
        fits = (tokens <= mt) & (patches <= 2 * mt)
        t, p, m = tokens[fits], patches[fits], images[fits]
        only, bound = Budget(mt, "pack"), Budget(mt, "pack", max_patches=2 * mt)
        sp_tok, sp_patch = _speed_pair(t, p, m, [only, bound], algo, min_s=min_s)
        win = _windowed(t, p, m, bound, 2048, algo)
        car = _carried(t, p, m, bound, 2048, algo)
        lb_win = sum(max(math.ceil(int(t[s:s + 2048].sum()) / mt), math.ceil(int(p[s:s + 2048].sum()) / (2 * mt)))
                     for s in range(0, len(t), 2048))
        out.append({"max_tokens": mt, "max_patches": 2 * mt, "samples": int(fits.sum()),
                    "patch_bound_share": float(np.mean(p / (2 * mt) > t / mt)),
                    "token_lb": math.ceil(int(t.sum()) / mt), "patch_lb": math.ceil(int(p.sum()) / (2 * mt)),
                    "window_lb": lb_win, "batches": win["n_batches"], "fill": win["fill"],
                    "patch_fill": int(p.sum()) / (win["n_batches"] * 2 * mt),
                    "carry_batches": car["n_batches"], "carry_fill": car["fill"],
                    "carry_patch_fill": int(p.sum()) / (car["n_batches"] * 2 * mt),
                    "token_only_samples_per_s": sp_tok, "samples_per_s": sp_patch, "ratio": sp_patch / sp_tok,
                    "carry_samples_per_s": _speed(t, p, m, bound, algo, min_s=min_s, carry=True)})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--speed-seconds", type=float, default=1.0)
    ap.add_argument("--operator-rows", type=int, default=0,
                    help="(i) instead: batch_by_token_budget on a plain Ray Dataset of this many text rows "
                         "(bench_operator.py --text --carry 0.1; extra flags after -- go to it)")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.operator_rows:
        import bench_operator

        bench_operator.main(["--rows", str(args.operator_rows), "--text", "--carry", "0.1"]
                            + (["--json", args.json] if args.json else []) + extra)
        return
    tokens, patches, images = realistic_costs(args.n, args.seed)
    rows = []
    st, tr = _fixed_rows(tokens, 32)
    rows.append(_row("(a) batch_size=32 pad-to-longest", st, tr))
    st, tr = _fixed_rows(tokens, 4, width=512)
    rows.append(_row("(b) pad/truncate to 512, 4 per batch", st, tr))
    for mode in ("pack", "pad"):
        b = Budget(MAX_TOKENS, mode)
        st = plan_stats_arrays(tokens, patches, images,
                               plan_batches_arrays(tokens, patches, images, b, 0, "pack_greedy"), b)
        rows.append(_row(f"(c) {mode} greedy arrival order (whole set)", st,
                         speed=_speed(tokens, patches, images, b, "pack_greedy",
                                      min_s=args.speed_seconds)))
    for mode, algos in (("pad", ["pad_sorted_buckets", "pad_optimal_split"]),
                        ("pack", ["pack_best_fit_decreasing", "pack_first_fit_decreasing",
                                  "pad_sorted_buckets"])):
        b = Budget(MAX_TOKENS, mode)
        for algo in algos:
            speed = _speed(tokens, patches, images, b, algo, min_s=args.speed_seconds)
            # 2560: is carry just a bigger window? (carry plans 2048 new + its held samples)
            for window in (512, 2048, 8192) + ((2560,) if algo == algos[0] else ()):
                st = _windowed(tokens, patches, images, b, window, algo)
                rows.append(_row(f"(d) {mode} {algo} w={window}", st,
                                 speed=speed if window == 2048 else None))
        for algo in algos[:1] + (["pad_optimal_split"] if mode == "pad" else []):
            speed = _speed(tokens, patches, images, b, algo, min_s=args.speed_seconds, carry=True)
            for window in (512, 2048, 8192):
                st = _carried(tokens, patches, images, b, window, algo)
                rows.append(_row(f"(e) {mode} {algo} + carry w={window}", st,
                                 speed=speed if window == 2048 else None))
    multi = []
    for mt in (4096, 16384):
        fits = (tokens <= mt) & (patches <= 2 * mt)
        t, p, m = tokens[fits], patches[fits], images[fits]
        b = Budget(mt, "pack", max_patches=2 * mt)
        st = _windowed(t, p, m, b, 2048, "pack_best_fit_decreasing")
        multi.append({"max_tokens": mt, "max_patches": 2 * mt, "samples": int(fits.sum()), "fill": st["fill"],
                      "patch_bound": int(math.ceil(int(p.sum()) / (2 * mt))), "batches": st["n_batches"],
                      "samples_per_s": _speed(t, p, m, b, "pack_best_fit_decreasing", min_s=args.speed_seconds),
                      "carry_samples_per_s": _speed(t, p, m, b, "pack_best_fit_decreasing",
                                                    min_s=args.speed_seconds, carry=True)})
    bound = _patch_bound(args.n, args.seed, args.speed_seconds)
    print(f"n={args.n} samples, sum tokens={int(tokens.sum())}, mean={tokens.mean():.0f}, "
          f"max_tokens={MAX_TOKENS}")
    print(f"{'strategy':52s} {'fill':>7s} {'bfill':>7s} {'batches':>8s} {'LB':>6s} "
          f"{'LB_win':>7s} {'worst/B':>8s} {'trunc':>9s} {'samples/s':>10s}")
    for r in rows:
        sp = f"{r['samples_per_s']:10.0f}" if r["samples_per_s"] else f"{'':10s}"
        print(f"{r['strategy']:52s} {r['fill']:7.2%} {r['budget_fill']:7.2%} {r['n_batches']:8d} "
              f"{r['lower_bound']:6d} {r['window_lower_bound'] or '':>7} {r['largest_vs_budget']:8.2f} "
              f"{r['truncated_tokens']:9d} {sp}"
              + (" held mean {held_mean:.0f} max {held_max} (cap {cap:.0%}), waited <= {max_windows_waited}"
                 .format(**r["carry"]) if r["carry"] else ""))
    print("(g) multi-budget pack_best_fit_decreasing, max_patches = 2 * max_tokens, window 2048")
    for r in multi:
        print(f"    max_tokens {r['max_tokens']:6d}: {r['samples']} samples, fill {r['fill']:.2%}, "
              f"{r['batches']} batches "
              f"(patch bound {r['patch_bound']}), {r['samples_per_s']:.0f} samples/s, "
              f"{r['carry_samples_per_s']:.0f} with carry")
    print("(h) patch budget binding: Qwen2-VL-like mixture, max_patches = 2 * max_tokens, window 2048, "
          "pack_best_fit_decreasing")
    for r in bound:
        print(f"    max_tokens {r['max_tokens']:6d}: {r['samples']} samples, patch-bound {r['patch_bound_share']:.1%} "
              f"of them; LB tokens {r['token_lb']}, patches {r['patch_lb']}, LB_win {r['window_lb']}\n"
              f"        windows: {r['batches']} batches, fill {r['fill']:.2%} (patches {r['patch_fill']:.2%}); "
              f"carry: {r['carry_batches']} batches, fill {r['carry_fill']:.2%} (patches {r['carry_patch_fill']:.2%})\n"
              f"        samples/s: token budget alone {r['token_only_samples_per_s']:.0f}, with the patch budget "
              f"{r['samples_per_s']:.0f} (ratio {r['ratio']:.2f}), with carry {r['carry_samples_per_s']:.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"n": args.n, "seed": args.seed, "max_tokens": MAX_TOKENS, "algorithms": sorted(ALGORITHMS),
                       "rows": rows, "multi_budget": multi, "patch_bound": bound}, f, indent=1)


if __name__ == "__main__":
    main()
