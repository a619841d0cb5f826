"""How well mixed the training order is, and what mixing costs (batching/shuffle.py).

A dataset laid out as HF / LLaVA-OneVision sets are: ``--subsets`` folders of WebDataset
shards, one folder per subset, sorted names (``sub-00`` ... ``sub-15``). Each variant runs one
epoch through the real pipeline (``pipeline.batch_dataset`` on a local Ray cluster,
deterministic mode) and takes the order in which the batches deliver the samples (batch
after batch, sample after sample). A sample's subset is the folder of its read unit. Reported:

  rank_corr   Spearman's rho between a sample's listing position and its training position
              (1 = file order, 0 = mixed; target |rho| <= 0.05)
  worst_tv    the epoch cut into 20 parts in training order: the largest total-variation
              distance between a part's subset mix and the whole epoch's (target within
              1.5x a random permutation's)
  samples/s   samples delivered per second of the whole pass (graph build included), best of
              ``--repeat`` passes (each pass must give the same order: deterministic mode)
  holder_mb   the payload holders' peak memory (measured rows waiting for materialize)

Variants: ``none`` (file order), ``units`` (seeded unit order), ``samples`` (units + the
default buffer, and a buffer of ``--small-buffer``), epoch 1 of the default, and two
references computed on the same samples without Ray: a uniformly random permutation (the
floor) and a plain shuffle buffer of the default size over file order (what a
``local_shuffle_buffer_size`` over unshuffled files gives).

    python benchmarks/bench_mixing.py [--subsets 16] [--per-subset 400] [--shard-size 50]
        [--cpus 6] [--small-buffer 1024] [--repeat 2] [--json PATH]

``--blend SIZES`` (instead): three sources (Parquet, WebDataset, LLaVA) of those sizes blended by
``--weights`` (formats/sources.py), each epoch's order from ``local_batches`` (the Ray path's
order in deterministic mode), cut into 5 and into 20 parts: per source, the epoch's count
against its target and the largest gap between its share of a part and its weight, for parts
of the blend's order (``blend``) and of a uniformly random order of the same samples (``random``:
the gap a plain random draw leaves), worst over ``--seeds`` seeds x ``--epochs`` epochs.

    python benchmarks/bench_mixing.py --blend 300,300,300 [--weights 0.6,0.3,0.1] [--epochs 3] [--seeds 5]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_mmbatch import schema as S  # noqa: E402
from ray_mmbatch.batching.mixing import order_figures  # noqa: E402
from ray_mmbatch.batching.shuffle import ShuffleBuffer  # noqa: E402
from ray_mmbatch.config import Config  # noqa: E402
from ray_mmbatch.data.position import ROW_BITS  # noqa: E402


def make_dataset(root: str, subsets: int, per_subset: int, shard_size: int) -> str:
    """``subsets`` sorted subsets of WebDataset shards in one folder (``sub-00-*.tar`` ...), made once
    per shape. One folder, not a folder per subset: since issue 33 a folder of data folders is a
    dataset of configs, read as a blend (one source each, stratified), which is not what this
    measures: the order of ONE source whose listing is sorted by subset."""
    import shutil

    from ray_mmbatch.synthetic.generate import generate_dataset

    path = os.path.join(root, f"mix1-{subsets}x{per_subset}-{shard_size}")
    if not os.path.exists(os.path.join(path, "done")):
        os.makedirs(path, exist_ok=True)
        for k in range(subsets):
            tmp = os.path.join(path, f".tmp-{k:02d}")
            generate_dataset(tmp, per_subset, "webdataset", seed=k, shard_size=shard_size, workers=1)
            for name in sorted(os.listdir(tmp)):
                if name.endswith(".tar"):
                    os.replace(os.path.join(tmp, name), os.path.join(path, f"sub-{k:02d}-{name}"))
            shutil.rmtree(tmp)
        Path(path, "done").write_text("")
    return path


def subset_of_units(cfg: Config) -> tuple[list[int], list[str]]:
    """(subset index per read unit in the listing, subset names)."""
    from ray_mmbatch.formats.units import read_units

    units = read_units(cfg.data.path, cfg.data)[0]
    sub = [u["rel"].rsplit("/", 1)[-1][:6] for u in units]  # sub-NN
    names = sorted(set(sub))
    return [names.index(x) for x in sub], names


def one_pass(cfg: Config, pad_id: int, epoch: int = 0) -> dict:
    """One epoch through the pipeline: training order as (listing position, unit), speed, holder peak."""
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic

    set_deterministic(True)
    t0 = time.perf_counter()
    ds, payloads = batch_dataset(cfg, pad_id, epoch=epoch, return_payloads=True)
    positions: list[int] = []
    first = None
    for row in ds.iter_rows():
        positions += [int(p) for p in row[S.BATCH_POSITIONS][:int(row[S.BATCH_N_SAMPLES])]]
        if first is None and positions:
            first = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    held = payloads.stats()
    return {"positions": np.asarray(positions, dtype=np.int64), "wall_s": wall, "first_s": first,
            "samples_per_s": len(positions) / wall,
            "holder_peak_mb": sum(s["peak_bytes"] for s in held) / 2**20}


def figures(positions: np.ndarray, unit_subset: np.ndarray) -> dict:
    order = np.argsort(np.argsort(positions, kind="stable"), kind="stable")  # listing rank of each sample
    return order_figures(order, unit_subset[positions >> ROW_BITS])


def _worst_gaps(order: list[str], want: dict, parts: int) -> dict:
    """Per source: the largest |share of a part - weight| over ``parts`` equal parts of ``order``."""
    from collections import Counter

    n = len(order)
    bounds = [k * n // parts for k in range(parts + 1)]
    gaps = {f: 0.0 for f in want}
    for a, b in zip(bounds, bounds[1:]):
        if b > a:
            c = Counter(order[a:b])
            for f in want:
                gaps[f] = max(gaps[f], abs(c[f] / (b - a) - want[f]))
    return gaps


def blend_report(sizes: list[int], weights: list[float], epochs: int, root: str, seeds: int = 1) -> list[dict]:
    """Realized shares of a blend per part of each epoch (see the module docstring)."""
    from collections import Counter

    from ray_mmbatch import local_batches
    from ray_mmbatch.formats.sources import source_of
    from ray_mmbatch.synthetic.generate import generate_dataset

    fmts = ("parquet", "webdataset", "llava")
    cfg = Config()
    cfg.data.sources = []
    for fmt, n, w in zip(fmts, sizes, weights):
        d = os.path.join(root, f"blend-{fmt}-{n}")
        if not os.path.exists(os.path.join(d, "manifest.json")):
            generate_dataset(d, n, fmt, seed=1, shard_size=50, workers=1)
        cfg.data.sources.append({"path": d, "name": fmt, "weight": w})
    cfg.budget.max_tokens = 4096
    total = sum(sizes)
    want = {f: w / sum(weights) for f, w in zip(fmts, weights)}
    rng = np.random.default_rng(0)
    out = []
    for seed in range(seeds):
        cfg.train.seed = seed
        for epoch in range(epochs):
            batches = [[str(s) for s in b["sample_ids"]] for b in local_batches(cfg, epoch=epoch)]
            src = [source_of(i) for b in batches for i in b]
            rand = list(rng.permutation(src))
            row = {"seed": seed, "epoch": epoch, "samples": len(src), "batches": len(batches),
                   "counts": dict(Counter(src)), "targets": {f: round(want[f] * total) for f in fmts}}
            for parts in (5, 20):
                row[f"worst_gap_blend_{parts}"] = _worst_gaps(src, want, parts)
                row[f"worst_gap_random_{parts}"] = _worst_gaps(rand, want, parts)
            out.append(row)
    return out


def blend_cost(rows: int = 200_000, capacity: int = 16_384, window: int = 2_048) -> dict:
    """Rows/s of the plain and the stratified shuffle buffer, and BatchMix's time per window of
    batches of 10 (three sources at 0.6 / 0.3 / 0.1; light rows as the plan stage holds them)."""
    from ray_mmbatch.batching.shuffle import BatchMix
    from ray_mmbatch.formats.sources import source_of

    shares = {"a": 0.6, "b": 0.3, "c": 0.1}
    items = [{S.SAMPLE_ID: f"{'abc'[i % 3]}:{i}"} for i in range(rows)]

    def label(r):
        return source_of(str(r[S.SAMPLE_ID]))

    out = {}
    for name, kw in (("plain", {}), ("stratified", {"shares": shares, "label": label})):
        buf, t, n = ShuffleBuffer(capacity, 0, 0, **kw), time.perf_counter(), 0
        for k in range(0, rows, window):
            part = items[k:k + window]
            n += len(buf.push(part, list(range(k, k + len(part)))))
        n += len(buf.flush())
        assert n == rows
        out[f"{name}_rows_per_s"] = rows / (time.perf_counter() - t)
    batches = [items[k:k + 10] for k in range(0, window, 10)]
    t = time.perf_counter()
    BatchMix(shares, label).order(batches)
    out["batch_mix_ms_per_window"] = (time.perf_counter() - t) * 1e3
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blend", default="", help="sizes of three sources, e.g. 300,300,300: the blend report instead")
    ap.add_argument("--weights", default="0.6,0.3,0.1")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seeds", type=int, default=1, help="--blend: train.seed 0 .. N-1, each for --epochs epochs")
    ap.add_argument("--subsets", type=int, default=16)
    ap.add_argument("--per-subset", type=int, default=400)
    ap.add_argument("--shard-size", type=int, default=50, help="samples per tar shard (the read unit)")
    ap.add_argument("--cpus", type=int, default=6, help="logical CPUs (a local training run's data CPUs)")
    ap.add_argument("--small-buffer", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=2, help="passes per variant: best samples/s, same order checked")
    ap.add_argument("--data-root", default=os.path.join(tempfile.gettempdir(), "ray_mmbatch_bench_mixing"))
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if args.blend:
        rows = blend_report([int(x) for x in args.blend.split(",")], [float(x) for x in args.weights.split(",")],
                            args.epochs, args.data_root, args.seeds)
        for r in rows:
            print(f"seed {r['seed']} epoch {r['epoch']}: {r['samples']} samples in {r['batches']} batches, "
                  f"counts {r['counts']} (targets {r['targets']})")
            for parts in (5, 20):
                for label in ("blend", "random"):
                    gaps = ", ".join(f"{f} {g:.3f}" for f, g in r[f"worst_gap_{label}_{parts}"].items())
                    print(f"  worst |share - weight| over {parts:>2} parts, {label:<6}: {gaps}")
        for parts in (5, 20):
            for label in ("blend", "random"):
                worst = max(g for r in rows for g in r[f"worst_gap_{label}_{parts}"].values())
                print(f"worst over all seeds and epochs, {parts:>2} parts, {label:<6}: {worst:.3f}")
        cost = blend_cost()
        print(f"cost: plain buffer {cost['plain_rows_per_s'] / 1e3:.0f}k rows/s, stratified "
              f"{cost['stratified_rows_per_s'] / 1e3:.0f}k rows/s, BatchMix "
              f"{cost['batch_mix_ms_per_window']:.1f} ms per window of 2,048 rows")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return rows

    import ray

    from ray_mmbatch.models import configure
    from ray_mmbatch.train.trainer import tokenizer_ids

    path = make_dataset(args.data_root, args.subsets, args.per_subset, args.shard_size)
    base = Config()
    base.data.path = path
    base.budget.mode, base.budget.max_tokens = "pack", 4096
    base = configure(base)
    pad_id = tokenizer_ids(base)["pad_id"]
    unit_subset, names = subset_of_units(base)
    unit_subset = np.asarray(unit_subset)
    default_buffer = base.data.shuffle_buffer

    ray.init("local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ramp = base.data.shuffle_ramp
    variants = [("none", "none", 0, 0, ramp), ("units", "units", 0, 0, ramp),
                (f"samples, buffer {default_buffer}, ramp {ramp} (default)", "samples", default_buffer, 0, ramp),
                (f"samples, buffer {default_buffer}, ramp {ramp}, epoch 1", "samples", default_buffer, 1, ramp),
                (f"samples, buffer {default_buffer}, ramp 0 (fill first)", "samples", default_buffer, 0, 0.0),
                (f"samples, buffer {args.small_buffer}, ramp {ramp}", "samples", args.small_buffer, 0, ramp)]
    results = []
    all_positions = None
    try:
        one_pass(base, pad_id)  # warm-up: actor start-up, tokenizer files in the page cache
        for label, mode, buffer, epoch, ramp in variants:
            cfg = copy.deepcopy(base)
            cfg.data.shuffle, cfg.data.shuffle_buffer = mode, buffer or base.data.shuffle_buffer
            cfg.data.shuffle_ramp = ramp
            runs = [one_pass(cfg, pad_id, epoch) for _ in range(args.repeat)]
            r = max(runs, key=lambda x: x["samples_per_s"])
            assert all(np.array_equal(x["positions"], r["positions"]) for x in runs), f"{label}: order not repeated"
            if all_positions is None:
                all_positions = np.sort(r["positions"])
            assert np.array_equal(np.sort(r["positions"]), all_positions), f"{label}: samples differ"
            results.append(dict(variant=label, samples=len(r["positions"]), **figures(r["positions"], unit_subset),
                                samples_per_s=r["samples_per_s"], holder_peak_mb=r["holder_peak_mb"],
                                first_s=min(x["first_s"] for x in runs)))
    finally:
        ray.shutdown()

    rng = np.random.default_rng(0)
    floor = rng.permutation(all_positions)
    results.append(dict(variant="random permutation (floor, no Ray)", samples=len(floor),
                        **figures(floor, unit_subset)))
    stream = all_positions.tolist()
    for size in (default_buffer, args.small_buffer):
        plain = ShuffleBuffer(size, seed=0, epoch=0)
        plain_order = np.asarray(plain.push(stream, stream) + plain.flush(), dtype=np.int64)
        results.append(dict(variant=f"plain buffer {size} over file order (no Ray)", samples=len(plain_order),
                            **figures(plain_order, unit_subset)))

    units = len(unit_subset)
    print(f"{args.subsets} subsets x {args.per_subset} samples, {units} read units of {args.shard_size}, "
          f"{args.cpus} CPUs, pack 4096")
    print(f"{'variant':<48} {'rank_corr':>9} {'worst_tv':>8} {'samples/s':>9} {'holder_mb':>9} {'1st s':>6}")
    for r in results:
        sps = f"{r['samples_per_s']:9.1f}" if "samples_per_s" in r else f"{'-':>9}"
        mb = f"{r['holder_peak_mb']:9.1f}" if "holder_peak_mb" in r else f"{'-':>9}"
        first = f"{r['first_s']:6.2f}" if r.get("first_s") is not None else f"{'-':>6}"
        print(f"{r['variant']:<48} {r['rank_correlation']:9.3f} {r['worst_part_distance']:8.3f} {sps} {mb} {first}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "subsets": names, "results": results}, indent=1))


if __name__ == "__main__":
    main()
