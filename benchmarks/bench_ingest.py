"""Is the Ray Data ingest path at least as fast as a plain torch DataLoader doing the same work?

Both sides make ONE full pass over the same Parquet files and do the same per-sample work
with the same pure functions: read (pyarrow) -> ``parquet_rows`` -> ``measure_batch`` (batches
of ``data.measure_batch`` rows: one tokenizer call, image headers only) -> ``materialize_sample``
for every usable sample (decode + resize + patchify to uint8, expand image tokens), then keep
the counts and drop the pixels:

    (a) ray         ``pipeline.inspect_dataset(cfg)``: read_raw (one pyarrow read per row group)
                    fused with InspectStage (ONE actor pool: measure + materialize per block),
                    the path of jobs/inspect_data.py; Ray is started (``ray.init("local",
                    num_cpus=--cpus)``, one idle worker per CPU) before the clock starts, the
                    actors' start-up (each imports transformers for the tokenizer) is timed
    (b) dataloader  ``torch.utils.data.DataLoader(num_workers=2, batch_size=None)`` over a
                    map-style Dataset whose item i is a slice of ``measure_batch`` rows of one
                    Parquet row group

Reported: samples/s and MB/s of compressed image bytes read (every sample, skipped or not),
and the ratio ray / dataloader. Each repeat runs the DataLoader first (no Ray processes
alive), then starts Ray, times its pass and shuts it down, so neither side competes with
the other's idle processes for the two cores. The two passes must agree on the sample
count, token / patch sums and image bytes, otherwise the script fails: the same work is
being timed.

    python benchmarks/bench_ingest.py [--data DIR] [--samples 2000] [--repeat 2] [--json PATH]
    python benchmarks/bench_ingest.py --mode train --data DIR --cpus 6 [--first-batch-only]
        [--shuffle-buffer N] [--shuffle-ramp R]
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_mmbatch import schema as S  # noqa: E402
from ray_mmbatch.config import Config  # noqa: E402


# ------------------------------------------------------------------ DataLoader side
@functools.lru_cache(maxsize=2)  # per worker process: consecutive slices share one row-group read
def _row_group(path: str, group: int, columns: tuple[str, ...]):
    import pyarrow.parquet as pq

    return pq.ParquetFile(path).read_row_group(group, columns=list(columns))


class ParquetMeasureMaterialize:
    """Map-style Dataset: item i = one slice of <= measure_batch rows, measured and materialized."""

    def __init__(self, files: list[str], cfg: Config):
        import pyarrow.parquet as pq

        self.cfg = cfg
        names = pq.read_schema(files[0]).names
        self.columns = tuple(c for c in (cfg.data.id_column, cfg.data.image_column, cfg.data.text_column)
                             if c in names)
        self.units = []  # (file, row group, first row in group, rows, first row in file)
        step = cfg.data.measure_batch
        for f in files:
            meta, offset = pq.ParquetFile(f).metadata, 0
            for g in range(meta.num_row_groups):
                rows = meta.row_group(g).num_rows
                self.units += [(f, g, s, min(step, rows - s), offset + s) for s in range(0, rows, step)]
                offset += rows

    def __len__(self) -> int:
        return len(self.units)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        from ray_mmbatch.data.image import ImageSkip
        from ray_mmbatch.data.materialize import materialize_sample
        from ray_mmbatch.data.measure import measure_batch
        from ray_mmbatch.data.text.tokenizer import load_tokenizer
        from ray_mmbatch.formats.parquet import parquet_rows

        path, group, start, rows, file_row = self.units[i]
        part = _row_group(path, group, self.columns).slice(start, rows)
        raw = parquet_rows(part, self.cfg.data, file_name=os.path.basename(path), row_offset=file_row)
        batch = {c: raw.column(c).to_pylist() for c in raw.column_names}
        m = measure_batch(batch, self.cfg.image, load_tokenizer(self.cfg.text.tokenizer), self.cfg.text)
        return summarize(m, self.cfg, materialize_sample, ImageSkip)


def summarize(m: dict, cfg: Config, materialize_sample, image_skip) -> dict[str, np.ndarray]:
    """Materialize every usable row of a measured batch; keep what InspectStage keeps (counts)."""
    n = len(m[S.SAMPLE_ID])
    ok = np.zeros(n, dtype=bool)
    mismatch = np.zeros(n, dtype=bool)
    for i in range(n):
        if m[S.SKIP_REASON][i]:
            continue
        try:
            out = materialize_sample({k: v[i] for k, v in m.items()}, cfg.image)
        except image_skip:
            continue
        ok[i] = True
        mismatch[i] = len(out["input_ids"]) != int(m[S.TOKENS][i]) or len(out["patches"]) != int(m[S.PATCHES][i])
    nbytes = np.array([sum(len(b) for b in (imgs or ())) for imgs in m[S.IMAGES]], dtype=np.int64)
    return {"ok": ok, "tokens": np.asarray(m[S.TOKENS], dtype=np.int64) * ok,
            "patches": np.asarray(m[S.PATCHES], dtype=np.int64) * ok, "image_bytes": nbytes, "mismatch": mismatch}


def run_dataloader(files: list[str], cfg: Config, workers: int) -> dict:
    from torch.utils.data import DataLoader

    totals = {"samples": 0, "ok": 0, "tokens": 0, "patches": 0, "image_bytes": 0, "mismatch": 0}
    t0 = time.perf_counter()
    loader = DataLoader(ParquetMeasureMaterialize(files, cfg), batch_size=None, shuffle=False,
                        num_workers=workers, collate_fn=lambda x: x, persistent_workers=False)
    for item in loader:
        totals["samples"] += len(item["ok"])
        for k in ("ok", "tokens", "patches", "image_bytes", "mismatch"):
            totals[k] += int(np.sum(item[k]))
    totals["wall_s"] = time.perf_counter() - t0
    return totals


# ------------------------------------------------------------------ Ray side
# Ray passes to compare, by DataContext settings applied before the pass. (The former
# "ray/parquet-v1" variant is gone: formats/units.py reads Parquet with pyarrow per row group, so
# Ray's Parquet datasource settings no longer change anything.)
RAY_VARIANTS = {
    "ray": {},
}


def run_ray(data: str, cfg: Config, cpus: int, context: dict | None = None) -> dict:
    """One inspect_dataset pass on a fresh local cluster, with ``context`` set on the DataContext."""

    from ray_mmbatch.dataflow.inspection import inspect_dataset
    from ray_mmbatch.dataflow.pipeline import set_deterministic

    with _local_ray(cpus) as ctx:
        for k, v in (context or {}).items():
            setattr(ctx, k, v)
        set_deterministic(False)
        summary = inspect_dataset(cfg)  # times itself: graph build + the whole pass
    return {"samples": summary["samples_read"], "ok": summary["samples_ok"],
            "tokens": int(summary["tokens"].get("sum", 0)), "patches": int(summary["patches"].get("sum", 0)),
            "image_bytes": int(round(summary["image_mb_per_s"] * summary["wall_s"] * 2**20)),
            "mismatch": summary["length_mismatch"], "wall_s": summary["wall_s"]}


def _worker_ready() -> int:
    return os.getpid()


@contextlib.contextmanager
def _local_ray(cpus: int):
    """A fresh local cluster for one pass, its worker pool up before the clock starts (one live
    process per CPU) and Ray Data's own actors asked for as ``connect`` asks for them (a training run
    starts them while it checks the data and builds the model); yields the DataContext (progress output
    off); shut down after."""
    import ray

    from ray_mmbatch.dataflow.pipeline import warm_up_ray_data

    ray.init("local", num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        warm_up_ray_data()
        ready = ray.remote(num_cpus=1)(_worker_ready)
        ray.get([ready.remote() for _ in range(cpus)])
        ctx = ray.data.DataContext.get_current()
        ctx.enable_progress_bars = False
        ctx.print_on_execution_start = False
        yield ctx
    finally:
        ray.shutdown()


# ------------------------------------------------------------------ training path (--mode train)
class ShardedTrainingPath:
    """Iterable Dataset for the DataLoader: worker w of n runs ``local_batches(shard=(w, n))``,
    the training data path in-process through the same stage objects the Ray graph runs
    (read units w, w+n, ... -> MeasureStage -> CarryPlanStage windows + end-of-stream flush
    -> MaterializeStage -> decode), and yields per-batch counts. Differences from the Ray
    path: each worker plans its own stream (its own windows and carry), so batch boundaries
    differ; the samples, skips and real tokens must not (checked). Each batch goes to the main
    process decoded (its arrays), as a training DataLoader hands it over: the Ray side's train
    loop decodes each batch it is handed too."""

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __iter__(self):
        from torch.utils.data import get_worker_info

        from ray_mmbatch.dataflow.local import local_batches

        info = get_worker_info()
        shard = (info.id, info.num_workers) if info is not None else (0, 1)
        for item in local_batches(self.cfg, with_skips=True, shard=shard):
            if "skipped" in item:
                yield {"samples": 0, "skipped": len(item["skipped"]), "real_tokens": 0, "batches": 0}
            else:
                yield {"samples": len(item["sample_ids"]), "skipped": 0, "real_tokens": int(item["real_tokens"]),
                       "batches": 1, "batch": item}


def _pools_started_at() -> float | None:
    """Unix time the first measure / materialize actor of the pass finished starting (GCS actor
    table, as train/stall.py reads it): "the pools starting" in the first-batch figure."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    rows = [gcs_pb2.ActorTableData.FromString(t)
            for t in state._connect_and_get_accessor().get_actor_table(None, None)]
    starts = [r.start_time / 1e3 for r in rows if r.start_time and
              ("MeasureStage" in r.class_name or "MaterializeStage" in r.class_name)]
    return min(starts) if starts else None


def _train_totals() -> dict:
    return {"samples": 0, "skipped": 0, "real_tokens": 0, "batches": 0, "first_s": None, "first_samples": 0}


def _first(totals: dict, t0: float) -> None:
    """Mark the first batch: start-up (the clock up to it) is told apart from the steady rate after it."""
    if totals["first_s"] is None and totals["samples"]:
        totals["first_s"], totals["first_samples"] = time.perf_counter() - t0, totals["samples"]


def _steady(x: dict) -> float:
    """samples/s after the first batch (the steady state of the pass)."""
    dt = x["wall_s"] - (x["first_s"] or 0.0)
    return (x["samples"] - x["first_samples"]) / dt if dt > 0 else 0.0


def run_dataloader_train(cfg: Config, workers: int, first_only: bool = False) -> dict:
    from torch.utils.data import DataLoader, IterableDataset

    class _DS(ShardedTrainingPath, IterableDataset):
        pass

    totals = _train_totals()
    t0 = time.perf_counter()
    for item in DataLoader(_DS(cfg), batch_size=None, num_workers=workers, persistent_workers=False):
        for k in ("samples", "skipped", "real_tokens", "batches"):
            totals[k] += int(item[k])
        _first(totals, t0)
        if first_only and totals["first_s"] is not None:
            break
    totals["wall_s"] = time.perf_counter() - t0
    return totals


def run_ray_train(cfg: Config, cpus: int, first_only: bool = False) -> dict:
    """One epoch of ``pipeline.batch_dataset`` (what each Train worker's shard comes from), iterated
    on the driver one BATCH row at a time with every payload decoded, as the train loop does."""
    import json as _json

    from ray_mmbatch.batching.collate import decode_batch
    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic
    from ray_mmbatch.models import configure, token_ids

    with _local_ray(cpus):
        cfg = configure(cfg)
        pad_id = token_ids(cfg)["pad_id"]
        set_deterministic(cfg.train.deterministic)
        totals = _train_totals()
        t0, wall0 = time.perf_counter(), time.time()
        first_at = None
        for row in batch_dataset(cfg, pad_id).iter_rows():
            totals["skipped"] += len(_json.loads(row[S.BATCH_SKIPPED]))
            n = int(row[S.BATCH_N_SAMPLES])
            if n:
                decode_batch(bytes(row[S.BATCH_PAYLOAD]))
                totals["samples"] += n
                totals["real_tokens"] += int(row[S.BATCH_REAL_TOKENS])
                totals["batches"] += 1
                _first(totals, t0)
                first_at = first_at or time.time()
                if first_only:
                    break
        totals["wall_s"] = time.perf_counter() - t0
        pools = _pools_started_at()
        totals["pools_s"] = pools - wall0 if pools else None  # pools up, from the start of the pass
        totals["after_pools_s"] = first_at - pools if pools and first_at else None
    return totals


def main_train(args, data: str, cfg: Config) -> list[dict]:
    print(f"training path: DataLoader num_workers={args.loader_workers} vs Ray (num_cpus={args.cpus}, "
          f"actors/stage {args.ray_workers or 'auto'}); budget {cfg.budget.mode} {cfg.budget.max_tokens} tokens, "
          f"window {cfg.budget.window}, shuffle {cfg.data.shuffle}", flush=True)
    print(f"{'run':>3}  {'path':<12}{'samples':>8}{'skipped':>8}{'batches':>8}{'wall s':>8}{'samples/s':>11}"
          f"{'ray/DL':>8}{'1st s':>7}{'steady/s':>9}{'ray/DL':>8}{'load 1m':>8}")
    runs = []
    first = args.first_batch_only
    for rep in range(args.repeat):
        dl = run_dataloader_train(cfg, args.loader_workers, first_only=first)
        load_dl = os.getloadavg()[0]
        ry = run_ray_train(cfg, args.cpus, first_only=first)
        load_ray = os.getloadavg()[0]
        if first:  # the time to the first batch only: each side stops there
            for side, x, load in (("dataloader", dl, load_dl), ("ray", ry, load_ray)):
                after = f"pools up at {x['pools_s']:.2f} s, first batch {x['after_pools_s']:.2f} s after" \
                    if x.get("after_pools_s") is not None else ""
                print(f"{rep:>3}  {side:<12}{x['samples']:>8}{x['skipped']:>8}{x['batches']:>8}{x['wall_s']:>8.2f}"
                      f"{'':>11}{'':>8}{x['first_s'] or 0:>7.2f}{'':>9}{'':>8}{load:>8.2f}  {after}", flush=True)
            runs.append({"repeat": rep, "dataloader": dict(dl, load1=load_dl), "ray": dict(ry, load1=load_ray)})
            continue
        for k in ("samples", "skipped", "real_tokens"):
            if dl[k] != ry[k]:
                raise SystemExit(f"ray and dataloader disagree on {k}: {ry[k]} != {dl[k]}; not the same work")
        ratio = (ry["samples"] / ry["wall_s"]) / (dl["samples"] / dl["wall_s"])
        steady = _steady(ry) / max(_steady(dl), 1e-9)
        for side, x, load, r, sr in (("dataloader", dl, load_dl, None, None), ("ray", ry, load_ray, ratio, steady)):
            print(f"{rep:>3}  {side:<12}{x['samples']:>8}{x['skipped']:>8}{x['batches']:>8}{x['wall_s']:>8.2f}"
                  f"{x['samples'] / x['wall_s']:>11.1f}{f'{r:.2f}' if r else '':>8}{x['first_s'] or 0:>7.2f}"
                  f"{_steady(x):>9.1f}{f'{sr:.2f}' if sr else '':>8}{load:>8.2f}"
                  + (f"  pools up {x['pools_s']:.2f} s, 1st batch +{x['after_pools_s']:.2f} s"
                     if x.get("after_pools_s") is not None else ""), flush=True)
        runs.append({"repeat": rep, "dataloader": dict(dl, load1=load_dl, steady=_steady(dl)),
                     "ray": dict(ry, load1=load_ray, steady=_steady(ry)), "ratio": ratio, "steady_ratio": steady})
    return runs


# ------------------------------------------------------------------ driver
def _rates(r: dict) -> dict:
    r["samples_per_s"] = r["samples"] / r["wall_s"]
    r["image_mb_per_s"] = r["image_bytes"] / 2**20 / r["wall_s"]
    return r


def _check_same_work(a: dict, b: dict) -> None:
    for k in ("samples", "ok", "tokens", "patches", "mismatch"):
        if a[k] != b[k]:
            raise SystemExit(f"ray and dataloader disagree on {k}: {a[k]} != {b[k]}; not the same work")
    if abs(a["image_bytes"] - b["image_bytes"]) > 1024:  # ray's figure is rebuilt from a rate (float)
        raise SystemExit(f"image bytes differ: {a['image_bytes']} vs {b['image_bytes']}")
    if a["mismatch"]:
        raise SystemExit(f"{a['mismatch']} samples materialized to a length other than measured")


def _print_row(rep: int, side: str, x: dict, ratio: float | None) -> None:
    r = f"{ratio:.2f}" if ratio else ""
    print(f"{rep:>3}  {side:<16}{x['samples']:>8}{x['image_bytes'] / 2**20:>7.1f}{x['wall_s']:>8.2f}"
          f"{x['samples_per_s']:>11.1f}{x['image_mb_per_s']:>8.2f}{r:>8}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", help="Parquet dataset folder (default: generate --samples under a temp dir)")
    p.add_argument("--samples", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeat", type=int, default=2, help="passes per side (timings are noisy)")
    p.add_argument("--cpus", type=int, default=4,
                   help="ray.init num_cpus (logical); the actor pool is capped at this")
    p.add_argument("--ray-workers", type=int, default=None,
                   help="Ray actors per pool (data.preprocess_workers; default: auto, sized from the CPUs)")
    p.add_argument("--loader-workers", type=int, default=2, help="DataLoader num_workers")
    p.add_argument("--measure-batch", type=int, default=64, help="rows per measure call, both sides")
    p.add_argument("--ray", nargs="+", choices=sorted(RAY_VARIANTS), default=list(RAY_VARIANTS),
                   help="Ray passes per repeat (see RAY_VARIANTS)")
    p.add_argument("--only", choices=("ray", "dataloader"), help="run one side only")
    p.add_argument("--json", metavar="PATH", help="also write the results here")
    p.add_argument("--first-batch-only", action="store_true",
                   help="--mode train: stop each side at its first batch (the start-up figure on large data)")
    p.add_argument("--shuffle-buffer", type=int, default=None, help="data.shuffle_buffer (default: the config's)")
    p.add_argument("--shuffle-ramp", type=float, default=None, help="data.shuffle_ramp (default: the config's)")
    p.add_argument("--mode", choices=("inspect", "train"), default="inspect",
                   help="inspect: read -> measure -> materialize (inspect_data's path); train: the training "
                        "data path, read -> measure -> plan -> materialize -> decode, every batch")
    args = p.parse_args(argv)

    from common import data_or_generated

    data, tmp = data_or_generated(args.data, args.samples, args.seed, "bench_ingest_")
    files = sorted(glob.glob(os.path.join(data, "**", "*.parquet"), recursive=True))
    if not files:
        raise SystemExit(f"no Parquet files under {data}")
    cfg = Config()
    cfg.data.path, cfg.data.format = data, "parquet"
    cfg.data.preprocess_workers, cfg.data.measure_batch = args.ray_workers, args.measure_batch
    if args.shuffle_buffer is not None:
        cfg.data.shuffle_buffer = args.shuffle_buffer
    if args.shuffle_ramp is not None:
        cfg.data.shuffle_ramp = args.shuffle_ramp
    if args.mode == "train":
        runs = main_train(args, data, cfg)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "files": len(files), "runs": runs}, indent=1))
        if tmp:
            tmp.cleanup()
        return 0

    print(f"{len(files)} Parquet files under {data}, {os.cpu_count()} cores; ray num_cpus={args.cpus}, "
          f"actors/stage<={args.ray_workers}; DataLoader num_workers={args.loader_workers}", flush=True)
    print(f"{'run':>3}  {'path':<16}{'samples':>8}{'MB':>7}{'wall s':>8}{'samples/s':>11}{'MB/s':>8}{'ray/DL':>8}")
    runs = []
    for rep in range(args.repeat):
        run = {"repeat": rep, "dataloader": None, "ratio": {}}
        if args.only != "ray":
            run["dataloader"] = _rates(run_dataloader(files, cfg, args.loader_workers))
            _print_row(rep, "dataloader", run["dataloader"], None)
        for side in ([] if args.only == "dataloader" else args.ray):
            r = run[side] = _rates(run_ray(data, cfg, args.cpus, RAY_VARIANTS[side]))
            ratio = None
            if run["dataloader"]:
                _check_same_work(r, run["dataloader"])
                ratio = run["ratio"][side] = r["samples_per_s"] / run["dataloader"]["samples_per_s"]
            _print_row(rep, side, r, ratio)
        runs.append(run)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "files": len(files), "runs": runs}, indent=1))
    if tmp:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
