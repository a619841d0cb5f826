"""Does the default model learn from the images? Right images vs images shuffled across samples.

Question: on the project's generated data, does training lower the loss well below
its start, and does the trained model use the pixels - i.e. is its held-out loss
clearly higher when each sample gets another sample's image?

Method (one process, CPU, fp32, ``torch.set_num_threads(2)``, pure path, no Ray)::

    generate_dataset(parquet, seed) -> parquet_rows -> measure_batch -> fit_batch_to_budget
    keep single-image scene samples whose answers describe the picture:
        caption       "<image>" -> "A large red circle at the top-left; ... on a solid blue background."
        conversation  "What colour is the star at the top?" -> "It is red."  (and 7 other question kinds)
    split by sample index: every ``--heldout-every``-th sample is held out, the rest trains
    materialize_sample once per sample (decode, resize, patchify)
    train: plan_batches_arrays(Budget(max_tokens)) -> collate_pack -> optimizer_step, default
           ModelConfig, AdamW + warm-up/cosine (train/step.py), fresh pack order per epoch,
           until ``--steps`` or ``--train-s`` seconds
    evaluate held-out samples whose image grid (t, h, w) is shared by another held-out sample:
        right     each sample with its own image
        shuffled  the SAME packed batches, but within each same-grid group the patches are
                  rotated (a random derangement), so every sample sees another sample's
                  image with identical token / patch counts and positions
    loss = mean CE over target (answer) tokens; also over the target tokens that name a
    colour or a shape (" red", " circle", ...: single tokens in the shipped tokenizer)

Spread: per-sample paired differences (shuffled - right CE, summed over a sample's
targets) bootstrapped over samples (95% interval of the per-token difference), and
the per-batch differences (min / median / max). Each evaluation's
first pack's total is checked against ``token_loss_sum`` (the training loss path).

    python benchmarks/bench_learning.py [--samples 3000] [--steps 1500] [--train-s 180] [--json PATH]

Cost: generating 3,000 samples ~30-45 s (2 processes), measure + materialize ~10 s,
training ``--train-s`` at most, evaluation ~15 s; ~5 min on the 2-core dev machine.
Figures, command and analysis: benchmarks/RESULTS.md ("## Learning from images").
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import read_measured  # noqa: E402  (benchmarks/ is on sys.path when a script runs)

from ray_mmbatch import schema as S
from ray_mmbatch.batching import Budget, collate_pack, plan_batches_arrays
from ray_mmbatch.config import BudgetConfig, Config
from ray_mmbatch.data.materialize import materialize_sample
from ray_mmbatch.data.text.tokenizer import load_tokenizer, special_ids
from ray_mmbatch.models.builtin import build_model, count_parameters
from ray_mmbatch.synthetic.draw import COLOURS, SHAPES
from ray_mmbatch.synthetic.generate import generate_dataset
from ray_mmbatch.train.step import batch_to_torch, build_optimizer, optimizer_step, token_loss_sum

CAPTION_PROMPTS = (S.IMAGE_PLACEHOLDER, f"{S.IMAGE_PLACEHOLDER}\nWrite a short caption for this picture.")
CATEGORIES = ("caption", "conversation")


# ------------------------------------------------------------------ data
def read_measured_rows(data_dir: str, cfg: Config, tok, fit: BudgetConfig) -> list[dict]:
    """Every parquet file under ``data_dir`` -> measured rows, file order, each fitted to ``fit`` alone.

    ``fit`` is the project's oversize policy (truncate the text after the image): it caps
    long conversations, whose later turns mostly repeat answers already in the context.
    """
    m = read_measured(data_dir, cfg, tok, fit)
    return [{c: m[c][i] for c in m} for i in range(len(m[S.SAMPLE_ID]))]


def scene_category(row: dict) -> str:
    """'caption' / 'conversation' for single-image scene samples, else '' (documents, multi-image, text)."""
    if row[S.SKIP_REASON] or int(row[S.N_IMAGES]) != 1:
        return ""
    conv = json.loads(row[S.CONVERSATIONS])
    first = next(t["value"] for t in conv if t["from"] == "human")
    if first.strip() in CAPTION_PROMPTS:
        return "caption"
    return "" if "title of this page" in first else "conversation"


def word_token_ids(tok, words) -> set[int]:
    """Ids of " word" for every word that is a single token (how answers spell them mid-sentence)."""
    out = set()
    for w in words:
        ids = tok.encode(" " + w, add_special_tokens=False)
        if len(ids) == 1:
            out.add(int(ids[0]))
    return out


def pack_groups(samples: list[dict], max_tokens: int, seed: int) -> list[list[int]]:
    """Index groups from the project's planner (pack mode, default algorithm)."""
    tokens = np.array([len(s["input_ids"]) for s in samples])
    patches = np.array([len(s["patches"]) for s in samples])
    images = np.array([len(s["grids"]) for s in samples])
    return plan_batches_arrays(tokens, patches, images, Budget(max_tokens=max_tokens, mode="pack"), seed)


def same_grid_derangement(samples: list[dict], rng: np.random.Generator) -> tuple[list[int], np.ndarray]:
    """(indices of samples in a same-grid group of >= 2, donor[i] = whose image sample i gets).

    Within each group: random order, then everyone takes the next one's image, so
    nobody keeps their own and every image is used exactly once.
    """
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(tuple(np.asarray(s["grids"]).reshape(-1).tolist()), []).append(i)
    donor = np.arange(len(samples))
    covered = []
    for members in groups.values():
        if len(members) < 2:
            continue
        order = [members[k] for k in rng.permutation(len(members))]
        for a, b in zip(order, order[1:] + order[:1]):
            donor[a] = b
        covered += members
    return sorted(covered), donor


def with_donor_images(samples: list[dict], donor: np.ndarray) -> list[dict]:
    return [dict(s, patches=samples[int(donor[i])]["patches"]) for i, s in enumerate(samples)]


# ------------------------------------------------------------------ evaluation
@torch.no_grad()
def per_sample_ce(model, batch: dict, word_ids: torch.Tensor, check: bool = False) -> dict:
    """CE summed per sample of a packed batch: all targets and colour/shape-word targets, with counts.

    ``check``: also run the training loss path (``token_loss_sum``, a second forward) and
    require the same total, so this split measures what training minimizes.
    """
    tb = batch_to_torch(batch, "cpu")
    hidden = model.hidden_states(tb)[0]
    labels = tb["labels"][0]
    at = torch.nonzero(labels != S.IGNORE_INDEX).squeeze(1)
    ce = F.cross_entropy(F.linear(hidden[at], model.embed.weight).float(), labels[at], reduction="none")
    if check:
        ref, n_ref = token_loss_sum(model, tb)
        if int(n_ref) != len(at) or not torch.isclose(ce.sum().double(), ref.double(), rtol=1e-4, atol=1e-2):
            raise AssertionError(f"per-token CE sum {float(ce.sum())} != token_loss_sum {float(ref)}")
    owner = torch.searchsorted(tb["cu_seqlens"].long(), at, right=True) - 1
    n = len(batch["sample_ids"])
    word = torch.isin(labels[at], word_ids)
    out = {}
    for name, keep in (("all", torch.ones_like(word)), ("word", word)):
        out[f"{name}_ce"] = torch.zeros(n, dtype=torch.float64).index_add_(0, owner[keep], ce[keep].double()).numpy()
        out[f"{name}_n"] = torch.bincount(owner[keep], minlength=n).numpy()
    return out


def evaluate(model, samples: list[dict], groups: list[list[int]], word_ids: torch.Tensor) -> dict:
    """Per-sample CE sums / counts (aligned with ``samples``) and per-batch mean CE."""
    model.eval()
    n = len(samples)
    res = {k: np.zeros(n) for k in ("all_ce", "all_n", "word_ce", "word_n")}
    batch_loss = []
    for k, g in enumerate(groups):
        r = per_sample_ce(model, collate_pack([samples[i] for i in g], 0), word_ids, check=k == 0)
        for k in res:
            res[k][g] = r[k]
        batch_loss.append(r["all_ce"].sum() / max(r["all_n"].sum(), 1))
    res["batch_loss"] = np.array(batch_loss)
    return res


def mean_loss(res: dict, name: str, mask=None) -> float:
    mask = np.ones(len(res[f"{name}_n"]), bool) if mask is None else mask
    return float(res[f"{name}_ce"][mask].sum() / max(res[f"{name}_n"][mask].sum(), 1))


def bootstrap_diff(right: dict, shuffled: dict, name: str, mask, rng, reps: int = 2000) -> tuple[float, float]:
    """95% interval of (shuffled - right) per-token loss, resampling samples (paired)."""
    idx = np.flatnonzero(mask & (right[f"{name}_n"] > 0))
    d = shuffled[f"{name}_ce"][idx] - right[f"{name}_ce"][idx]
    n = right[f"{name}_n"][idx]
    draws = rng.integers(0, len(idx), size=(reps, len(idx)))
    stats = d[draws].sum(1) / n[draws].sum(1)
    return float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))


# ------------------------------------------------------------------ training
def train(model, samples: list[dict], cfg: Config, steps: int, train_s: float, seed: int, log_every: int) -> dict:
    """Pack-mode steps over fresh plans of ``samples`` each epoch until ``steps`` or ``train_s`` seconds."""
    opt, sched = build_optimizer(model, cfg.train, steps)
    losses, start, epoch = [], time.perf_counter(), 0
    while len(losses) < steps and time.perf_counter() - start < train_s:
        for g in pack_groups(samples, cfg.budget.max_tokens, seed + epoch):
            out = optimizer_step(model, [collate_pack([samples[i] for i in g], 0)], opt, sched, cfg.train, "cpu")
            losses.append(out["loss"])
            if len(losses) % log_every == 0:
                print(f"  step {len(losses):4d}  loss {np.mean(losses[-log_every:]):.3f}  "
                      f"{time.perf_counter() - start:6.1f} s", flush=True)
            if len(losses) >= steps or time.perf_counter() - start >= train_s:
                break
        epoch += 1
    return {"losses": losses, "train_s": time.perf_counter() - start, "epochs": epoch}


# ------------------------------------------------------------------ main
def _row(label: str, right: float, shuffled: float, ci: tuple[float, float], n: int) -> str:
    return (f"{label:<34} {right:8.3f} {shuffled:9.3f} {shuffled - right:+8.3f}  "
            f"[{ci[0]:+.3f}, {ci[1]:+.3f}] {n:8d}")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", default="", help="generated parquet dir (reused if it has a manifest; default: temp)")
    p.add_argument("--samples", type=int, default=3000, help="samples to generate (all categories)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heldout-every", type=int, default=5, help="every k-th scene sample is held out")
    p.add_argument("--steps", type=int, default=1500, help="optimizer steps (sets the cosine schedule)")
    p.add_argument("--train-s", type=float, default=180.0, help="stop training after this many seconds")
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--max-tokens", type=int, default=1024, help="pack budget per step")
    p.add_argument("--max-sample-tokens", type=int, default=256,
                   help="longer samples are truncated to this (oversize policy 'truncate')")
    p.add_argument("--categories", default="caption,conversation")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    wall = time.perf_counter()
    from ray_mmbatch.run.defaults import resolve_defaults

    cfg = resolve_defaults(Config())  # the built-in model's schedule (10 warm-up steps), as the recorded figures used
    cfg.train.lr, cfg.train.precision, cfg.budget.max_tokens = args.lr, "fp32", args.max_tokens
    cats = tuple(c for c in args.categories.split(",") if c)
    tok = load_tokenizer("")

    data = args.data or tempfile.mkdtemp(prefix="bench_learning_")
    t = time.perf_counter()
    if not os.path.exists(os.path.join(data, "manifest.json")):
        generate_dataset(data, args.samples, "parquet", args.seed)
    gen_s = time.perf_counter() - t
    t = time.perf_counter()
    measured = read_measured_rows(data, cfg, tok, BudgetConfig(max_tokens=args.max_sample_tokens))
    rows = [(r, c) for r in measured if (c := scene_category(r)) in cats]
    train_s, held = [], []
    for k, (r, c) in enumerate(rows):
        s = dict(materialize_sample(r, cfg.image), category=c)
        (held if k % args.heldout_every == 0 else train_s).append(s)
    prep_s = time.perf_counter() - t
    print(f"data {data}: {len(rows)} scene samples ({', '.join(cats)}), train {len(train_s)}, "
          f"held out {len(held)}; generate {gen_s:.1f} s, measure+materialize {prep_s:.1f} s", flush=True)

    rng = np.random.default_rng(args.seed)
    covered, donor = same_grid_derangement(held, rng)
    ev = [held[i] for i in covered]
    ev_shuf = with_donor_images(held, donor)
    ev_shuf = [ev_shuf[i] for i in covered]
    groups = pack_groups(ev, args.max_tokens, args.seed)
    word_ids = torch.tensor(sorted(word_token_ids(tok, list(COLOURS) + list(SHAPES))))

    sp = special_ids(tok)
    model = build_model(cfg.model, cfg.image, vocab_size=len(tok), image_token_id=sp[S.IMAGE_PAD],
                        pad_id=sp[S.PAD_TOKEN], seed=args.seed)
    init = evaluate(model, ev, groups, word_ids)
    print(f"model {count_parameters(model) / 1e6:.2f} M params; eval set {len(ev)} held-out samples in "
          f"same-grid groups ({len(held) - len(ev)} with a unique grid left out), {len(groups)} packs; "
          f"initial held-out loss {mean_loss(init, 'all'):.3f}", flush=True)
    tr = train(model, train_s, cfg, args.steps, args.train_s, args.seed, log_every=25)
    right = evaluate(model, ev, groups, word_ids)
    shuf = evaluate(model, ev_shuf, groups, word_ids)

    losses = tr["losses"]
    tail = min(20, len(losses))
    bd = shuf["batch_loss"] - right["batch_loss"]
    cat_of = np.array([s["category"] for s in ev])
    table = []
    for label, name, mask in [("all target tokens", "all", None), ("colour/shape-word targets", "word", None)] + \
            [(f"  {c}: all targets", "all", cat_of == c) for c in cats] + \
            [(f"  {c}: colour/shape words", "word", cat_of == c) for c in cats]:
        m = np.ones(len(ev), bool) if mask is None else mask
        if not right[f"{name}_n"][m].sum():
            continue
        r_loss, s_loss = mean_loss(right, name, m), mean_loss(shuf, name, m)
        ci = bootstrap_diff(right, shuf, name, m, np.random.default_rng(args.seed + 1))
        table.append({"what": label.strip(), "right": r_loss, "shuffled": s_loss, "diff": s_loss - r_loss,
                      "ci95": ci, "tokens": int(right[f"{name}_n"][m].sum()),
                      "initial": mean_loss(init, name, m)})
    out = {
        "command_args": vars(args), "data": data, "samples_generated": args.samples,
        "scene_samples": len(rows), "train_samples": len(train_s), "heldout_samples": len(held),
        "eval_samples": len(ev), "eval_packs": len(groups), "params": count_parameters(model),
        "steps": len(losses), "epochs": tr["epochs"], "train_s": tr["train_s"],
        "first_step_loss": losses[0], "final_train_loss": float(np.mean(losses[-tail:])),
        "initial_heldout_loss": mean_loss(init, "all"), "table": table,
        "per_batch_diff": {"min": float(bd.min()), "median": float(np.median(bd)), "max": float(bd.max()),
                           "positive": int((bd > 0).sum()), "batches": len(bd)},
        "generate_s": gen_s, "prepare_s": prep_s, "wall_s": time.perf_counter() - wall,
        "loss_curve": [float(np.mean(losses[i:i + 25])) for i in range(0, len(losses), 25)],
    }
    print(f"\ntrained {len(losses)} steps ({tr['epochs']} epochs started) in {tr['train_s']:.0f} s; "
          f"initial held-out loss {out['initial_heldout_loss']:.3f}, first step {losses[0]:.3f}, "
          f"final train loss (mean of last {tail} steps) {out['final_train_loss']:.3f}")
    print(f"\n{'held-out loss (nats/token)':<34} {'right':>8} {'shuffled':>9} {'diff':>8}  "
          f"{'boot 95%':<17} {'tokens':>7}")
    for row in table:
        print(_row(row["what"], row["right"], row["shuffled"], row["ci95"], row["tokens"]))
    pb = out["per_batch_diff"]
    print(f"per-pack diff (all targets): min {pb['min']:+.3f}, median {pb['median']:+.3f}, max {pb['max']:+.3f}; "
          f"shuffled worse in {pb['positive']}/{pb['batches']} packs; wall {out['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
