"""The plan stage in Ray: what carry buys end to end, and how fast one plan actor is.

(a) Ray, the real pipeline (``pipeline.batch_dataset``: read -> measure -> plan ->
    materialize, deterministic mode) over generated Parquet data, once with
    ``budget.carry = 0`` (each window planned on its own by stateless tasks) and once
    with the default carry (one CarryPlanStage actor + the readers' end-of-stream row),
    and a third time with the payload holders capped at ``--payload-mb`` (rows beyond it
    spill to disk, payloads.py). Reported: batches, fill (real / padded tokens of the
    batches), wall time, the holders' peak memory and spilled rows, and the check that
    every run delivers exactly the same sample ids, each once.
(b) The ceiling of the one plan actor that carry needs: ``CarryPlanStage`` (and the
    stateless ``plan_rows``) called in-process on numpy batches of the LIGHT rows that
    measure sends on (the measured rows themselves wait in the payload store,
    payloads.py), window by window, as Ray calls them. Reported: samples/s, and the
    bytes per sample through the plan stage (its input and output blocks as Arrow)
    next to the measured row it no longer carries; Ray's per-block transfer is not
    included.

    python benchmarks/bench_plan_stage.py [--data DIR] [--samples 4000] [--window 512]
        [--max-tokens 4096] [--mode pack] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import read_measured  # noqa: E402

from ray_mmbatch import schema as S  # noqa: E402
from ray_mmbatch.config import Config  # noqa: E402
from ray_mmbatch.data.errors import decode_skips


def _ray_pass(cfg: Config, pad_id: int) -> dict:
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic

    set_deterministic(True)
    t0 = time.perf_counter()
    ds, payloads = batch_dataset(cfg, pad_id, return_payloads=True)
    rows = ds.take_all()
    wall = time.perf_counter() - t0
    held = payloads.stats()
    real = sum(int(r[S.BATCH_REAL_TOKENS]) for r in rows)
    padded = sum(int(r[S.BATCH_PADDED_TOKENS]) for r in rows)
    ids = [s for r in rows for s in r[S.BATCH_SAMPLE_IDS]]
    skipped = [s.sample_id for r in rows for s in decode_skips(r[S.BATCH_SKIPPED])]
    assert len(ids) == len(set(ids)), "a sample arrived twice"
    return {"batches": sum(1 for r in rows if int(r[S.BATCH_N_SAMPLES])), "fill": real / padded,
            "real_tokens": real, "samples": len(ids), "skipped": len(skipped), "wall_s": wall,
            "holder_peak_mb": sum(h["peak_bytes"] for h in held) / 2**20,
            "spilled_rows": sum(h["spilled_rows"] for h in held), "rows_put": sum(h["rows_put"] for h in held),
            "ids": sorted(ids + skipped)}


def _actor_ceiling(measured: dict, cfg: Config, window: int, repeat: int) -> dict:
    import pyarrow as pa

    from ray_mmbatch.dataflow.payload_store import LocalPayloads
    from ray_mmbatch.dataflow.stages import CarryPlanStage, light_rows, plan_rows

    n = len(measured[S.SAMPLE_ID])
    nbytes = sum(len(b) for imgs in measured[S.IMAGES] for b in imgs) + \
        sum(len(t) * 4 for t in measured[S.TEXT_IDS])
    light = light_rows(measured, LocalPayloads())
    light_in = pa.Table.from_pydict({k: list(v) for k, v in light.items()}).nbytes
    out = {}
    for name in ("carry", "stateless"):
        best = float("inf")
        for _ in range(repeat):
            stage = CarryPlanStage(cfg.budget, 0, 0) if name == "carry" else None
            t0 = time.perf_counter()
            planned = 0
            plan_out = 0
            for s in range(0, n, window):
                batch = {k: v[s:s + window] for k, v in light.items()}
                res = stage(batch) if stage else plan_rows(batch, cfg.budget, 0, 0)
                planned += sum(len(ids) for ids in res[S.BATCH_SAMPLE_IDS])
                plan_out += pa.Table.from_pydict(res).nbytes
            if stage:
                planned += sum(len(g) for g in stage.planner.flush())
            best = min(best, time.perf_counter() - t0)
        out[name] = {"samples_per_s": n / best, "planned": planned,
                     "bytes_per_sample_through": (light_in + plan_out) / n}
    out["mb_per_sample"] = nbytes / 2**20 / n
    out["light_in_bytes_per_sample"] = light_in / n
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="", help="Parquet folder (default: generate --samples)")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--mode", default="pack", choices=["pack", "pad"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default="")
    ap.add_argument("--payload-mb", type=float, default=8.0,
                    help="a third Ray pass with data.payload_memory_mb at this cap (0 = skip it)")
    args = ap.parse_args(argv)

    import ray

    from ray_mmbatch.data.text.tokenizer import load_tokenizer
    from ray_mmbatch.synthetic.generate import generate_dataset
    from ray_mmbatch.train.trainer import tokenizer_ids

    data = args.data
    if not data:
        data = tempfile.mkdtemp(prefix="bench_plan_")
        generate_dataset(data, args.samples, "parquet", seed=0, shard_size=500, workers=2)
    cfg = Config()
    cfg.data.path, cfg.data.format = data, "parquet"
    cfg.budget.mode, cfg.budget.max_tokens, cfg.budget.window = args.mode, args.max_tokens, args.window
    pad_id = tokenizer_ids(cfg)["pad_id"]

    ray.init("local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    runs = {}
    try:
        for carry in (0.0, None):
            cfg.budget.carry = carry
            runs["carry 0 (windows on their own)" if carry == 0 else "carry default"] = _ray_pass(cfg, pad_id)
        if args.payload_mb:  # the holders' memory cap binding: rows beyond it spill to disk
            cfg.data.payload_memory_mb = args.payload_mb
            runs[f"carry default, cap {args.payload_mb:g} MB"] = _ray_pass(cfg, pad_id)
            cfg.data.payload_memory_mb = Config().data.payload_memory_mb
    finally:
        ray.shutdown()
    a, b = list(runs.values())[:2]
    assert a["ids"] == b["ids"], "carry changed which samples arrive"
    assert all(r["ids"] == b["ids"] for r in runs.values()), "the payload cap changed which samples arrive"
    cfg.budget.carry = None
    measured = read_measured(data, cfg, load_tokenizer(cfg.text.tokenizer), cfg.budget)
    ceiling = _actor_ceiling(measured, cfg, args.window, args.repeat)

    print(f"data {data}: {len(a['ids'])} samples read, mode {args.mode}, max_tokens {args.max_tokens}, "
          f"window {args.window}")
    print(f"{'(a) Ray pipeline':34s} {'batches':>8s} {'fill':>8s} {'samples':>8s} {'skipped':>8s} {'wall s':>7s} "
          f"{'holders peak MB':>16s} {'spilled rows':>13s}")
    for name, r in runs.items():
        print(f"    {name:30s} {r['batches']:8d} {r['fill']:8.2%} {r['samples']:8d} {r['skipped']:8d} "
              f"{r['wall_s']:7.1f} {r['holder_peak_mb']:16.1f} {r['spilled_rows']:13d}")
    print(f"(b) one process planning windows of {args.window} of light rows (a measured row is "
          f"{ceiling['mb_per_sample'] * 2**20 / 1024:.0f} kB; it waits in the payload store)")
    for name in ("carry", "stateless"):
        c = ceiling[name]
        print(f"    {name:30s} {c['samples_per_s']:10.0f} samples/s {c['bytes_per_sample_through']:8.0f} bytes/sample "
              f"through the plan stage (in + out)")
    if args.json:
        for r in runs.values():
            r.pop("ids")
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ray": runs, "actor": ceiling}, f, indent=1)


if __name__ == "__main__":
    main()
