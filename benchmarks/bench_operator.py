"""batch_by_token_budget on a user's own Ray Dataset (issue 25): fill and rows/s.

Synthetic rows with lognormal token counts (``id``, ``tokens``; with ``--text`` also an
``input_ids`` list of that length, so the operator collates packed / padded arrays), as a
plain Ray Dataset of ``--blocks`` Arrow blocks, materialized first so every pass reads the same
blocks. Passes, each timed from the first pull to the last batch consumed on the driver:

    fixed-32     ds.iter_batches(batch_size=32): what a plain loop gets; fill = real tokens /
                 (rows x the longest row of each batch), i.e. every batch padded to its longest
    op pack/pad  batch_by_token_budget(ds, mode=..., max_tokens=..., window=...), every output
                 column pulled (member lists, and with --text the collated arrays)
    in-process   the operator's task (operator.plan_window) over the same windows, no Ray: the
                 planning + collation ceiling of one core

Reported: batches, rows per batch, fill, rows/s, and that every id came back exactly once.

    python benchmarks/bench_operator.py [--rows 20000] [--max-tokens 4096] [--window 2048]
        [--mu 5.5] [--sigma 0.9] [--text] [--carry F] [--json PATH]

``bench_packing.py --operator-rows N`` runs this with ``--rows N`` (the 1 M-row figure).
Ray 2.60 has no length bucketing of its own to compare with (``iter_bucket_batches`` is the
open PR ray-project/ray#66053); only the fixed-size pass stands for Ray's batching.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_mmbatch.batching import Budget  # noqa: E402
from ray_mmbatch.dataflow.operator import batch_by_token_budget, plan_window  # noqa: E402


def make_tables(rows: int, blocks: int, mu: float, sigma: float, max_tokens: int, text: bool,
                seed: int = 0) -> list[pa.Table]:
    rng = np.random.default_rng(seed)
    tokens = np.clip(rng.lognormal(mu, sigma, rows).astype(np.int64), 1, max_tokens)
    out = []
    for part in np.array_split(np.arange(rows), blocks):
        cols = {"id": pa.array(part), "tokens": pa.array(tokens[part])}
        if text:
            lens = tokens[part]
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
            values = rng.integers(1, 50_000, int(lens.sum()), dtype=np.int32)
            cols["input_ids"] = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
        out.append(pa.table(cols))
    return out


def fixed_pass(ds) -> dict:
    t0 = time.perf_counter()
    n = batches = real = padded = 0
    for b in ds.iter_batches(batch_size=32, batch_format="numpy"):
        t = b["tokens"]
        n += len(t)
        batches += 1
        real += int(t.sum())
        padded += len(t) * int(t.max())
    wall = time.perf_counter() - t0
    return {"pass": "fixed-32", "batches": batches, "rows": n, "fill": real / padded, "wall_s": wall,
            "rows_per_s": n / wall, "exactly_once": None}


def op_pass(ds, mode: str, args, n_rows: int, carry: float = 0.0) -> dict:
    out = batch_by_token_budget(ds, mode=mode, max_tokens=args.max_tokens, window=args.window, seed=0, carry=carry)
    t0 = time.perf_counter()
    ids, batches, real, padded = [], 0, 0, 0
    for b in out.iter_batches(batch_size=None, batch_format="numpy"):
        batches += len(b["n_rows"])
        real += int(b["real_tokens"].sum())
        padded += int(b["padded_tokens"].sum())
        ids.extend(x for members in b["id"] for x in members)
    wall = time.perf_counter() - t0
    once = len(ids) == n_rows and sorted(ids) == list(range(n_rows))
    name = f"op {mode}" + (f" carry {carry:g}" if carry else "")
    return {"pass": name, "batches": batches, "rows": len(ids), "fill": real / padded, "wall_s": wall,
            "rows_per_s": len(ids) / wall, "exactly_once": once}


def local_pass(tables: list[pa.Table], mode: str, args) -> dict:
    budget = Budget(args.max_tokens, mode)
    t0 = time.perf_counter()
    batches = rows = real = padded = 0
    for table in tables:
        for start in range(0, table.num_rows, args.window):
            part = table.slice(start, args.window)
            batch = {c: part[c].to_numpy(zero_copy_only=False) for c in part.column_names}
            out = plan_window(batch, budget=budget)
            batches += len(out["n_rows"])
            rows += sum(out["n_rows"])
            real += sum(out["real_tokens"])
            padded += sum(out["padded_tokens"])
    wall = time.perf_counter() - t0
    return {"pass": f"in-process {mode}", "batches": batches, "rows": rows, "fill": real / padded, "wall_s": wall,
            "rows_per_s": rows / wall, "exactly_once": None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--blocks", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=2048)
    ap.add_argument("--mu", type=float, default=5.5)
    ap.add_argument("--sigma", type=float, default=0.9)
    ap.add_argument("--text", action="store_true", help="rows carry input_ids (the operator collates)")
    ap.add_argument("--carry", type=float, default=0.0,
                    help="also run the op with this carry (one task plans the windows in order, see operator.py)")
    ap.add_argument("--num-cpus", type=int, default=4)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)

    import ray

    ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    tables = make_tables(args.rows, args.blocks, args.mu, args.sigma, args.max_tokens, args.text)
    ds = ray.data.from_arrow(tables).materialize()
    tok = np.concatenate([t["tokens"].to_numpy() for t in tables])
    print(f"{args.rows} rows, tokens lognormal(mu={args.mu}, sigma={args.sigma}) clipped to [1, {args.max_tokens}]: "
          f"mean {tok.mean():.0f}, p50 {np.median(tok):.0f}, p99 {np.percentile(tok, 99):.0f}; "
          f"max_tokens {args.max_tokens}, window {args.window}, "
          f"{'text rows (collated)' if args.text else 'costs only'}")
    results = [fixed_pass(ds)]
    for mode in ("pack", "pad"):
        op_pass(ds, mode, args, args.rows)  # warm: the worker processes start, the modules load
        results.append(op_pass(ds, mode, args, args.rows))
        if args.carry:
            results.append(op_pass(ds, mode, args, args.rows, carry=args.carry))
    for mode in ("pack", "pad"):
        results.append(local_pass(tables, mode, args))
    print(f"{'pass':<20}{'batches':>8}{'rows/batch':>11}{'fill':>7}{'rows/s':>10}{'wall s':>8}  exactly once")
    for r in results:
        once = "-" if r["exactly_once"] is None else str(r["exactly_once"])
        print(f"{r['pass']:<20}{r['batches']:>8}{r['rows'] / r['batches']:>11.1f}{r['fill']:>7.3f}"
              f"{r['rows_per_s']:>10.0f}{r['wall_s']:>8.2f}  {once}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    ray.shutdown()


if __name__ == "__main__":
    main()
