"""The data check (jobs/inspect_data.py): read -> measure -> materialize every sample, keep counts.

One Ray Data actor stage (InspectStage) fused with the read; the driver gathers a JSON-able
summary for choosing budgets (``inspect_dataset``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import ray

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config, ImageConfig, TextConfig
from ray_mmbatch.dataflow.pipeline import stage_args


class InspectStage:
    """The data check in ONE actor stage: measure + materialize each block of RAW rows, keep counts.

    Fused on purpose (bench_ingest): a separate measure stage would ship every image's bytes
    (as pickled objects, Arrow cannot hold ndarrays of bytes) to a second actor pool that loads
    its own processes. Here each actor loads the tokenizer once, takes one read block
    (one Parquet row group / WebDataset shard / LLaVA chunk), measures it in slices of
    ``measure_batch`` rows (one tokenizer call each), materializes every usable sample
    (decode + resize + patchify, expand image tokens: per sample, that is Pillow's work)
    and returns only numbers and reasons.
    """

    def __init__(self, image_cfg: ImageConfig, text_cfg: TextConfig, measure_batch: int, decode: bool = True):
        from ray_mmbatch.data.text.encoder import tokenizer_for

        self.image_cfg, self.text_cfg, self.measure_batch = image_cfg, text_cfg, max(1, int(measure_batch))
        self.decode = bool(decode)  # False: image headers only (sizes, formats, bombs), no pixel decode
        self.tok = tokenizer_for(text_cfg)

    def __call__(self, block) -> dict[str, np.ndarray]:
        from ray_mmbatch.data.measure import measure_batch

        n = block.num_rows
        out: dict[str, list] = {k: [] for k in _INSPECT_COUNTS}
        for start in range(0, n, self.measure_batch):
            part = block.slice(start, self.measure_batch)
            raw = {c: part.column(c).to_pylist() for c in part.column_names}
            measured = measure_batch(raw, self.image_cfg, self.tok, self.text_cfg)
            reasons, mismatch = self._materialize(measured)
            out[S.SKIP_REASON] += reasons
            out["length_mismatch"] += mismatch
            for k in _COUNT_COLUMNS:
                out[k].append(np.asarray(measured[k], dtype=np.int64))
        ints = {k: (np.concatenate(v) if v else np.zeros(0, np.int64)) for k, v in out.items()
                if k not in (S.SKIP_REASON, "length_mismatch")}
        return {S.SAMPLE_ID: np.asarray(block.column(S.SAMPLE_ID).to_pylist(), dtype=object),
                S.SKIP_REASON: np.asarray(out[S.SKIP_REASON], dtype=object),
                "length_mismatch": np.asarray(out["length_mismatch"], dtype=bool),
                "image_bytes": image_bytes_per_row(block.column(S.IMAGES)), **ints}

    def _materialize(self, m: dict[str, Any]) -> tuple[list[str], list[bool]]:
        """Materialize every usable row; (skip reason, materialized length != measured) per row."""
        from ray_mmbatch.data.image import ImageSkip
        from ray_mmbatch.data.materialize import materialize_sample

        reasons, mismatch = [str(r) for r in m[S.SKIP_REASON]], [False] * len(m[S.SKIP_REASON])
        if not self.decode:
            return reasons, mismatch
        for i, reason in enumerate(reasons):
            if reason:
                continue
            try:
                s = materialize_sample({k: v[i] for k, v in m.items()}, self.image_cfg)
            except ImageSkip as e:
                reasons[i] = e.skip_reason()
                continue
            patches = len(s["patches"]) + len(s.get("video_patches", ()))
            mismatch[i] = len(s["input_ids"]) != int(m[S.TOKENS][i]) or patches != int(m[S.PATCHES][i])
        return reasons, mismatch


_COUNT_COLUMNS = (S.TOKENS, S.TEXT_TOKENS, S.IMAGE_TOKENS, S.PATCHES, S.N_IMAGES, S.VIDEO_TOKENS, S.N_FRAMES,
                  S.N_VIDEOS)
_INSPECT_COUNTS = (S.SKIP_REASON, "length_mismatch") + _COUNT_COLUMNS


def image_bytes_per_row(images) -> np.ndarray:
    """Encoded image bytes per row of a list<binary> Arrow column (null = 0), without a Python loop."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(images, pa.ChunkedArray):
        images = images.combine_chunks()
    n = len(images)
    flat = pc.list_flatten(images)
    if len(flat) == 0:
        return np.zeros(n, dtype=np.int64)
    lengths = pc.fill_null(pc.binary_length(flat), 0).to_numpy(zero_copy_only=False)
    rows = pc.list_parent_indices(images).to_numpy(zero_copy_only=False)
    return np.bincount(rows, weights=lengths, minlength=n).astype(np.int64)


def inspect_workers(cfg: Config, samples: int | None = None) -> int:
    """Actors for the data check: data.preprocess_workers (auto: 2, or 1 for at most pools.SMALL_EPOCH
    ``samples``, where a second actor's start costs more than it saves), at most the cluster's CPUs (one
    process per core)."""
    from ray_mmbatch.dataflow.pools import SMALL_EPOCH

    auto = 1 if samples is not None and samples <= SMALL_EPOCH else 2
    workers = max(1, cfg.data.preprocess_workers or auto)
    if ray.is_initialized():  # else Ray Data starts a local cluster of this machine's cores
        return max(1, min(workers, int(ray.cluster_resources().get("CPU", 1))))
    return workers


def _percentiles(x: np.ndarray) -> dict[str, float]:
    if len(x) == 0:
        return {}
    q = np.percentile(x, [0, 10, 50, 90, 99, 100])
    return {"min": float(q[0]), "p10": float(q[1]), "p50": float(q[2]), "p90": float(q[3]),
            "p99": float(q[4]), "max": float(q[5]), "mean": float(x.mean()), "sum": float(x.sum())}


DECODE_AUTO_MAX = 50_000
"""``decode="auto"``: decode every image (materialize) up to this many samples; above it, headers only."""


def inspect_dataset(cfg: Config, decode: str = "auto", progress=None) -> dict[str, Any]:
    """read -> measure (-> materialize) every sample; a JSON-able summary for choosing budgets.

    ``decode``: 'on' decodes every image (finds corrupt pixel data, checks that materialized lengths equal
    the measured ones), 'off' reads image headers only (sizes, formats, bombs: what the budgets need; a
    665k-record set in minutes), 'auto' = on up to DECODE_AUTO_MAX samples.
    ``progress`` (run/progress.Progress): its ``total`` is set from the listing (left None where the
    listing only guesses, WebDataset shards) and it is updated with the rows of each block as it arrives."""
    import time

    from ray_mmbatch.batching.suggest import suggest_budgets
    from ray_mmbatch.dataflow.read import read_raw

    t0 = time.perf_counter()
    # batch_size=None: one call per read block. Ray fuses the read into this actor stage and,
    # given a row count, would bundle read units (row groups) until it has that many ROWS OF
    # UNITS - for Parquet that packed every row group into one task on one actor.
    data = cfg.data
    if data.sources:  # every sample of every source once, not a blend's epoch (formats/sources.py)
        from ray_mmbatch.formats.sources import without_weights

        data = without_weights(data)
    from ray_mmbatch.formats.splits import expand
    from ray_mmbatch.formats.units import listed_rows, listing_summary, read_units

    data = expand(data)
    reader = read_units(data.path, data)
    listing = listing_summary(reader, data)
    if decode not in ("auto", "on", "off"):
        raise ValueError(f"decode must be auto, on or off, got {decode!r}")
    exact = listed_rows(reader)
    listed = listed_rows(reader, exact=False) if exact is None else exact
    if progress is not None:
        progress.total = exact
    workers = inspect_workers(cfg, exact)
    decoding = decode == "on" or (decode == "auto" and listed <= DECODE_AUTO_MAX)
    ds = read_raw(data.path, data, reader=reader).map_batches(
        InspectStage, batch_size=None, batch_format="pyarrow",
        fn_constructor_args=(cfg.image, cfg.text, cfg.data.measure_batch, decoding),
        compute=ray.data.ActorPoolStrategy(min_size=workers, max_size=workers), **stage_args(cfg))
    cols: dict[str, list] = {}
    for b in ds.iter_batches(batch_size=None, batch_format="numpy"):  # a block as it comes: progress
        for k, v in b.items():
            cols.setdefault(k, []).extend(v.tolist())
        if progress is not None:
            progress.update(len(b.get(S.SAMPLE_ID, ())))
    wall = time.perf_counter() - t0
    reasons = np.array(cols.get(S.SKIP_REASON, []), dtype=object)
    ok = np.array([not r for r in reasons], dtype=bool)
    skipped: dict[str, int] = {}
    examples: dict[str, list[str]] = {}
    files: dict[str, str] = {}  # read units that could not be read: one row each, id = the file (formats/)
    for sid, r in zip(cols.get(S.SAMPLE_ID, []), reasons):
        if r:
            key = S.parse_skip(r)[0]
            skipped[key] = skipped.get(key, 0) + 1
            if key == S.SKIP_UNREADABLE_FILE:
                files[str(sid)] = str(r)
            if len(examples.setdefault(key, [])) < 5:
                examples[key].append(sid)
    arr = {k: np.asarray(cols.get(k, []), dtype=np.int64)[ok] for k in _COUNT_COLUMNS}
    with_video = arr[S.N_VIDEOS] > 0
    nbytes = float(np.sum(cols.get("image_bytes", [0])))
    n = len(reasons) - len(files)
    per_source = {}
    if data.sources:  # several datasets (formats/sources.py): the counts of each
        from ray_mmbatch.formats.sources import by_source

        per_source = by_source([str(s) for s in cols.get(S.SAMPLE_ID, [])],
                               [S.parse_skip(r)[0] if r else "" for r in reasons])
        per_source = _blend_plan(cfg, per_source)
    for name, n_filtered in listing["filtered"].items():  # rows --filter left out: counted, never read further
        if name in per_source:
            per_source[name]["filtered"] = n_filtered
    return {
        "read_as": listing["read_as"], "pixels_decoded": decoding,
        **({"splits": listing["splits"]} if listing["splits"] else {}),
        **({"filtered": sum(listing["filtered"].values())} if listing["filtered"] else {}),
        **({"sources": per_source} if per_source else {}),
        "samples_read": n, "samples_ok": int(ok.sum()), "samples_skipped": int(n - ok.sum()),
        "skipped": skipped, "skipped_examples": examples,
        "skipped_files": len(files), "skipped_file_reasons": dict(list(files.items())[:20]),
        "length_mismatch": int(np.sum(cols.get("length_mismatch", [0]))),
        "tokens": _percentiles(arr[S.TOKENS]), "text_tokens": _percentiles(arr[S.TEXT_TOKENS]),
        "image_tokens": _percentiles(arr[S.IMAGE_TOKENS]), "patches": _percentiles(arr[S.PATCHES]),
        "images_per_sample": {str(k): int(v) for k, v in zip(*np.unique(arr[S.N_IMAGES], return_counts=True))},
        **({"samples_with_video": int(with_video.sum()),
            "video_tokens": _percentiles(arr[S.VIDEO_TOKENS][with_video]),
            "video_frames": _percentiles(arr[S.N_FRAMES][with_video]),
            "videos_per_sample": {str(k): int(v) for k, v in zip(*np.unique(arr[S.N_VIDEOS], return_counts=True))}}
           if with_video.any() else {}),
        "suggested_budgets": suggest_budgets(arr[S.TOKENS], arr[S.N_FRAMES], cfg.budget),
        "wall_s": wall, "samples_per_s": n / wall if wall else 0.0,
        "image_mb_per_s": nbytes / 2**20 / wall if wall else 0.0,
    }


def _blend_plan(cfg: Config, per_source: dict[str, dict]) -> dict[str, dict]:
    """A blend's weight and the samples each epoch draws from every source, beside what it holds."""
    from ray_mmbatch.formats.sources import blended, data_sources
    from ray_mmbatch.formats.units import read_units

    if not blended(cfg.data):
        return per_source
    plan = read_units(cfg.data.path, cfg.data)[2]["blend"]
    for src, target in zip(data_sources(cfg.data), plan.targets):
        per_source.setdefault(src.name, {"samples": 0, "skipped": 0}).update(weight=src.weight,
                                                                            epoch_samples=int(target))
    return per_source
