"""Text-only LLM data on your own Ray Dataset -> packed token-budget batches.

    python examples/token_budget_text.py [--rows 400] [--max-tokens 512] [--mode pack|pad]

Tokenizes a few hundred strings with the tokenizer shipped in the package (any Hugging Face
tokenizer works the same way), builds a plain ``ray.data.from_items`` Dataset of
``{"id", "input_ids"}`` rows and calls ``ray_mmbatch.batch_by_token_budget``: one output row per
batch, its members packed into one sequence of at most ``--max-tokens`` tokens with
``cu_seqlens`` and ``position_ids`` restarting per sample (pad mode: rows padded to the longest,
with an ``attention_mask``). Prints the batch count and the fill (real / padded tokens), next to
what fixed 32-row batches padded to their longest would fill. Joins the cluster in RAY_ADDRESS
if set, else starts Ray locally; runs in seconds.
"""
from __future__ import annotations

import argparse

import numpy as np
import ray

import ray_mmbatch
from ray_mmbatch.data.text.tokenizer import load_tokenizer
from ray_mmbatch.dataflow.operator import token_budget_stats

WORDS = ("the model reads tokens packed into one sequence while attention stays inside each sample "
         "ray data streams blocks of rows through tasks and a planner groups them under a budget").split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    """``n`` strings of lognormal length (a few words to a few hundred), reproducible."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(3.5, 0.9, n).astype(int), 3, 300)
    return [" ".join(rng.choice(WORDS, size=k)) for k in lengths]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--mode", choices=("pack", "pad"), default="pack")
    args = ap.parse_args(argv)

    tok = load_tokenizer()  # the shipped byte-level BPE; AutoTokenizer.from_pretrained(path) works too
    texts = make_texts(args.rows)
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    # the operator's budgets are the caller's: a row longer than max_tokens would raise, so cut here
    items = [{"id": f"doc-{i}", "input_ids": x[: args.max_tokens]} for i, x in enumerate(ids)]

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)  # RAY_ADDRESS, else local
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_items(items)

    batches = ray_mmbatch.batch_by_token_budget(ds, mode=args.mode, max_tokens=args.max_tokens, window=256, seed=0)
    rows = batches.take_all()
    stats = token_budget_stats(rows)
    first = rows[0]

    lens = np.array([len(x["input_ids"]) for x in items])
    fixed_padded = sum(len(c) * int(c.max()) for c in np.array_split(lens, range(32, len(lens), 32)))
    print(f"{stats['rows']} rows -> {stats['batches']} batches ({args.mode}, max_tokens={args.max_tokens}), "
          f"fill {stats['fill']:.3f}; fixed 32-row batches padded: {int(np.ceil(len(lens) / 32))} batches, "
          f"fill {lens.sum() / fixed_padded:.3f}")
    if args.mode == "pack":
        print(f"first batch: {first['n_rows']} samples, ids {first['id'][:3]}..., input_ids shape "
              f"{first['input_ids'].shape}, cu_seqlens {first['cu_seqlens'][:4].tolist()}...")
    else:
        print(f"first batch: {first['n_rows']} samples, input_ids shape {first['input_ids'].shape}, "
              f"attention_mask rows {first['attention_mask'].sum(axis=1)[:4].tolist()}...")
    return stats


if __name__ == "__main__":
    main()
