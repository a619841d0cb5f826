"""Driver side of a training run: connect to Ray, build the TorchTrainer, write summary.json.

``run_training(cfg)`` is what ``jobs/train.py`` and the Tune trials call.
"""
from __future__ import annotations

import csv
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import ray
from ray.train import DataConfig

from ray_mmbatch import schema as S
from ray_mmbatch.config import Config
from ray_mmbatch.data.errors import SkipRecord
from ray_mmbatch.formats import fs
from ray_mmbatch.formats.listing import in_one_listing as one_listing_per_run
from ray_mmbatch.formats.units import filtered_counts
from ray_mmbatch.run.defaults import resolve_defaults
from ray_mmbatch.run.rundir import RunDir, read_jsonl, write_jsonl
from ray_mmbatch.train import checkpoint as ckpt


class LosslessDataConfig(DataConfig):
    """Split the batch stream across workers without dropping rows.

    Ray Train's default ``streaming_split(equal=True)`` drops up to world_size-1
    rows to make shards equal; one row is a whole planned batch here, so that
    would silently lose samples. The train loop keeps ranks in lockstep itself.
    """

    def configure(self, datasets, world_size, worker_handles, worker_node_ids, **kwargs):
        output = [{} for _ in range(world_size)]
        hints = worker_node_ids if self._enable_shard_locality else None
        for name, ds in datasets.items():
            if ds.name is None:
                ds.set_name(name)
            ds = ds.copy(ds)
            ds.context.execution_options = self._resolve_execution_options(name)
            for i, split in enumerate(ds.streaming_split(world_size, equal=False, locality_hints=hints)):
                output[i][name] = split
        return output


def _running_cluster() -> str | None:
    """RAY_ADDRESS, or the cluster `ray start` last started on this machine; None if neither.

    Unlike ``address="auto"`` this never joins some other process's private
    ``ray.init()`` instance (a test session, a notebook) just because it is running.
    """
    try:
        from ray._private.services import get_ray_address_from_environment

        return get_ray_address_from_environment(None, None)
    except Exception:  # private API moved, or a stale file pointing nowhere
        return os.environ.get("RAY_ADDRESS") or None


#: Ray Train's controller poll of its workers (Ray's default 2 s) on a cluster ``connect`` starts itself
TRAIN_POLL_ENV, LOCAL_TRAIN_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"


def connect(num_cpus: int | None = None) -> None:
    """Join a running cluster (RAY_ADDRESS, or one from ``ray start``), else start one here.

    A cluster that answers is joined, with the token Ray keeps if it asks for one, or the run stops
    with the fix (run/cluster.py); only an address where nothing listens, and that RAY_ADDRESS did not
    name, is stale and gets a cluster started here."""
    if ray.is_initialized():
        return
    from ray_mmbatch.run.cluster import ClusterError, join_check

    kw = dict(log_to_driver=True, configure_logging=False)
    address = _running_cluster()
    if address and join_check(address) == "dead":
        if os.environ.get("RAY_ADDRESS"):
            raise ClusterError(f"RAY_ADDRESS={os.environ['RAY_ADDRESS']}: no Ray cluster listens at {address}; "
                               "start it (ray start --head / ray up), or unset RAY_ADDRESS to run on this machine")
        print(f"[ray_mmbatch] no cluster listens at {address} (stale); starting one here", flush=True)
        address = None
    if address:
        ray.init(address=address, **kw)
    else:
        # Actor pools hold their CPU slots for the whole run; with only as many slots as
        # cores (2 here) they can leave the read, a Train worker or a Tune trial no slot
        # and the stream stalls. Logical slots over the core count only let the stages
        # interleave (the pools are sized from the slots, pools.py).
        # Ray Train's controller polls its workers every 2 s (Ray's default), so a finished run, or
        # a tune trial, waited up to ~4 s more for it to notice (benchmarks/RESULTS.md, "A small
        # run's fixed cost"); the cluster started here (its processes inherit this) polls every 0.5 s.
        os.environ.setdefault(TRAIN_POLL_ENV, LOCAL_TRAIN_POLL_S)
        ray.init("local", num_cpus=max(num_cpus or 0, os.cpu_count() or 2, 8), include_dashboard=False, **kw)
    # progress bars only for a person at a terminal; logs stay readable
    ray.data.DataContext.get_current().enable_progress_bars = sys.stderr.isatty()
    from ray_mmbatch.dataflow.pipeline import warm_up_ray_data

    warm_up_ray_data()  # Ray Data's actors start while the driver checks the data and builds the model
    from ray_mmbatch.run.raylogs import after_connect

    after_connect()  # a command's quiet console: Ray's internal lines off (run/raylogs.py)


def tokenizer_ids(cfg: Config) -> dict[str, int]:
    """vocab size, image token id and pad id of the run's tokenizer (models.token_ids after configure)."""
    from ray_mmbatch.models import configure, token_ids

    return token_ids(configure(cfg))


def _finish_logs(out: Path) -> tuple[dict[str, int], list[dict], dict[str, tuple[str, str]]]:
    """batches.jsonl in (step, rank) order; skipped.jsonl -> skipped.csv (deduplicated by id).
    Returns (skips per reason, the batch records, {skipped id: (reason, detail)})."""
    lines = read_jsonl(out / RunDir.BATCHES)
    lines.sort(key=lambda r: (r["step"], r["rank"]))
    write_jsonl(out / RunDir.BATCHES, lines)
    skipped = {r["sample_id"]: (r["reason"], r["detail"]) for r in read_jsonl(out / RunDir.SKIP_LOG)}
    counts: dict[str, int] = {}
    with open(out / RunDir.SKIPPED, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sample_id", "reason", "detail"])
        for sid in sorted(skipped):
            reason, detail = skipped[sid]
            w.writerow([sid, reason, detail])
            counts[reason] = counts.get(reason, 0) + 1
    return counts, lines, skipped


def planned_samples(cfg: Config, per_epoch: int | None = None) -> int:
    """Rows to be read over the whole run (epochs x samples read per epoch) when it goes by
    epochs, for the learning-rate schedule; 0 with max_steps (the schedule uses the steps).
    ``per_epoch``: the run plan's count (run_plan), so a big listing is not counted twice."""
    if cfg.train.max_steps:
        return 0
    return max(1, cfg.train.epochs) * (samples_per_epoch(cfg) if per_epoch is None else per_epoch)


def samples_per_epoch(cfg: Config) -> int:
    """Rows one epoch reads, counted up front (formats/units.py count_samples), less the held-out share."""
    from ray_mmbatch.data.split import train_split
    from ray_mmbatch.formats.units import count_samples

    held = train_split(cfg.data)  # --eval-split: about that share of the rows is never trained
    return round(count_samples(cfg.data.path, cfg.data) * (1 - (held[1] if held else 0)))


def run_plan(cfg: Config, tokens_per_sample: float | None = None, sampled: int = 0) -> dict[str, Any]:
    """summary.json's ``plan`` (run/plan.py) of the resolved ``cfg``: the samples counted up front, and with
    ``tokens_per_sample`` (the pre-flight's mean over ``sampled`` samples) an estimate of the steps per epoch.
    A count that fails leaves the samples out of the plan; the run itself says why when it reads them."""
    from ray_mmbatch.run.plan import make_plan

    try:
        samples = samples_per_epoch(cfg)
    except (OSError, ValueError):
        samples = None
    return make_plan(cfg, samples, tokens_per_sample, sampled)


def _worker_resources(cfg: Config) -> dict[str, float]:
    res = {"CPU": cfg.train.cpus_per_worker}
    if cfg.train.use_gpu:
        res["GPU"] = cfg.train.gpus_per_worker
    if cfg.train.worker_resource:
        res[cfg.train.worker_resource] = 1.0
    return res


def fit(cfg: Config, run_name: str | None = None, callbacks: list | None = None, per_epoch: int | None = None,
        reader: tuple | None = None):
    """``build_trainer(...).fit()``, the ranks' records written under OUTPUT_DIR by this process
    (train/events.py: through Ray, so no shared disk is needed for progress and summary). ``per_epoch``: the
    samples an epoch reads, when the caller counted them already (planned_samples); ``reader``: the data's
    listing (formats/units.read_units), when the caller listed it already (a tune sweep lists once)."""
    from ray_mmbatch.run.trackers import open_trackers
    from ray_mmbatch.train.events import follow

    resolve_defaults(cfg)  # a Config() built in Python: output_dir and the schedule left to the mode
    check_output_locations(cfg)
    out = Path(cfg.train.output_dir).resolve()
    with follow(out, sink=open_trackers(cfg, out, run_name or "")) as channel:  # --report-to: run/trackers.py
        return build_trainer(cfg, run_name, callbacks, channel=channel, per_epoch=per_epoch, reader=reader).fit()


def build_trainer(cfg: Config, run_name: str | None = None, callbacks: list | None = None, channel=None,
                  per_epoch: int | None = None, reader: tuple | None = None):
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from ray_mmbatch.dataflow.pipeline import batch_dataset, set_deterministic
    from ray_mmbatch.formats.units import check_listing, listing_digest, read_units
    from ray_mmbatch.models import configure, token_ids
    from ray_mmbatch.train.loop import train_loop_per_worker

    cfg = configure(resolve_defaults(cfg))  # the mode's settings; a checkpoint's image / text settings
    check_output_locations(cfg)
    out = Path(cfg.train.output_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    cfg.train.output_dir = str(out)
    ids = token_ids(cfg)  # cfg is configured above: tokenizer_ids would configure it again
    set_deterministic(cfg.train.deterministic)

    name = run_name or cfg.train.run_name or out.name
    storage = storage_location(cfg)
    # the data position counts read units of this listing: a resume over another one fails here. The same
    # listing goes to every epoch's dataset (built in the Train controller's process): listed once a run
    reader = reader or read_units(cfg.data.path, cfg.data)
    listing = listing_digest(reader[0])
    check_listing(ckpt.read_latest_position(out, fs.join(storage, name)), listing, cfg.data.path)

    progress = ray.data.DataContext.get_current().enable_progress_bars

    def dataset_fn(epoch: int):
        def build():
            # Called at every worker-group start, in the Train controller's process, whose
            # DataContext is not the driver's: carry the settings over, then rebuild the
            # stream without the samples the checkpoint being restored already trained.
            set_deterministic(cfg.train.deterministic)
            ray.data.DataContext.get_current().enable_progress_bars = progress
            position = ckpt.read_latest_position(out, fs.join(storage, name), fallback=False)  # never ahead
            return batch_dataset(cfg, ids["pad_id"], position=position, epoch=epoch, reader=reader, samples=per_epoch)
        return build

    # One dataset per epoch, iterated one after the other by every rank (train/loop.py):
    # each is split and executed only when the ranks reach it, with its own seeds.
    datasets = {S.epoch_dataset_name(e): dataset_fn(e) for e in range(max(1, cfg.train.epochs))}

    # Train applies these execution options to the shard it splits; built here, on the
    # driver, so preserve_order (deterministic mode) really reaches the training stream.
    ingest = DataConfig.default_ingest_options()
    ingest.preserve_order = bool(cfg.train.deterministic)

    return TorchTrainer(
        train_loop_per_worker,
        train_loop_config={"cfg": cfg.to_dict(), **ids, "planned_samples": planned_samples(cfg, per_epoch),
                           "listing": listing, "channel": channel},
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu,
                                     resources_per_worker=_worker_resources(cfg)),
        run_config=RunConfig(
            name=name, storage_path=storage,
            failure_config=FailureConfig(max_failures=cfg.train.max_failures),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
            callbacks=callbacks or None,
        ),
        datasets=datasets,
        dataset_config=LosslessDataConfig(execution_options=ingest),
    )


def check_output_locations(cfg: Config) -> None:
    """``output_dir`` is a folder (logs are appended to, per rank); a bucket goes in ``storage``.

    A ``storage`` URI must be reachable at start (its bucket listed), so a typo or missing
    credentials fail here, naming the URI, not at the first checkpoint.
    """
    if fs.is_uri(cfg.train.output_dir):
        raise ValueError(f"--output-dir {cfg.train.output_dir}: the output dir is a folder (per-rank logs are "
                         "appended to); put checkpoints in a bucket with --storage "
                         f"{cfg.train.output_dir.rstrip('/')}/{RunDir.RAY_STORAGE} and give --output-dir a local or "
                         "shared folder")
    if fs.is_uri(cfg.train.storage):
        filesystem, path = fs.split(cfg.train.storage)
        bucket = path.split("/", 1)[0]
        try:
            info = filesystem.get_file_info(bucket)
        except OSError as e:
            raise fs.DataLocationError(f"--storage {cfg.train.storage}: cannot reach it ({e})") from None
        if info.type == pafs.FileType.NotFound:
            raise fs.DataLocationError(f"--storage {cfg.train.storage}: bucket {bucket!r} does not exist")


def check_storage_reaches_nodes(cfg: Config) -> None:
    """On a cluster of more than one node, checkpoints must go to a bucket or a shared folder (run/cluster.py)."""
    from ray_mmbatch.dataflow.pools import alive_nodes
    from ray_mmbatch.run.cluster import check_shared_storage

    check_shared_storage(cfg.train.storage, storage_location(cfg), len(alive_nodes(ray.nodes())))


def storage_location(cfg: Config) -> str:
    """Where Ray Train persists checkpoints (RunConfig.storage_path): train.storage or OUTPUT_DIR/ray_storage."""
    if cfg.train.storage:
        return cfg.train.storage if fs.is_uri(cfg.train.storage) else str(Path(fs.local_path(cfg.train.storage))
                                                                          .resolve())
    return str(Path(cfg.train.output_dir).resolve() / RunDir.RAY_STORAGE)


@one_listing_per_run
def run_training(cfg: Config, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train; return and write OUTPUT_DIR/summary.json (with ``plan``, run_plan's unless given). Each data
    source is listed once for the plan, the listing digest, the pipeline and the --filter counts
    (formats/listing.py)."""
    t0 = time.time()
    resolve_defaults(cfg)  # a Config() built in Python: the settings left to the mode (cli.py did it for a command)
    plan = plan or run_plan(cfg)
    from ray_mmbatch.models.trainable import check_config

    check_config(cfg)  # --freeze / --lora-*: a bad setting or a missing peft fails before Ray starts
    from ray_mmbatch.run.trackers import check_trackers

    check_trackers(cfg.train.report_to)  # --report-to: a tracker not installed fails before Ray starts
    connect(num_cpus=int(math.ceil(cfg.train.num_workers * cfg.train.cpus_per_worker)) + 6)
    check_storage_reaches_nodes(cfg)
    from ray_mmbatch.dataflow.pipeline import pools_for
    from ray_mmbatch.dataflow.pools import PLAN_CPUS
    from ray_mmbatch.run.datatime import summarize as summarize_data_time
    from ray_mmbatch.run.guards import TooManySkipped

    stopped = Path(cfg.train.output_dir) / RunDir.STOPPED
    stopped.unlink(missing_ok=True)  # from an earlier run in this dir
    # ResourceError now, not a stream waiting forever for slots; the count sizes a small epoch's pools
    sizes = pools_for(cfg, check=True, samples=plan.get("samples_per_epoch"))
    print(f"[ray_mmbatch] preprocessing: measure {sizes.measure[0]}-{sizes.measure[1]}, materialize "
          f"{sizes.materialize[0]}-{sizes.materialize[1]} actors of {sizes.slots:g} CPU slots "
          f"({'auto' if sizes.auto else '--preprocess-workers'})", flush=True)
    result = fit(cfg, per_epoch=plan.get("samples_per_epoch"))  # counted once, for the plan and the schedule
    out = Path(cfg.train.output_dir)
    skipped, batch_records, skipped_ids = _finish_logs(out)
    m = result.metrics or {}
    summary = {
        "steps": int(m.get("step", 0)),
        "samples": int(m.get("total_samples", 0)),
        "real_tokens": int(m.get("total_real_tokens", 0)),
        "padded_tokens": int(m.get("total_padded_tokens", 0)),
        "fill": (m.get("total_real_tokens", 0) / m["total_padded_tokens"]) if m.get("total_padded_tokens") else 0.0,
        "tokens_per_s": m.get("total_real_tokens", 0) / max(m.get("total_train_s", 0.0), 1e-9),
        "initial_loss": m.get("initial_loss"),
        "final_loss": _final_loss(out),
        "skipped": skipped,
        "skipped_total": sum(skipped.values()),
        "skipped_files": skipped.get(S.SKIP_UNREADABLE_FILE, 0),  # files that could not be read (in skipped.csv)
        "wall_s": time.time() - t0,
        "budget": cfg.to_dict()["budget"],
        "config": cfg.to_dict(),
        "checkpoint": result.checkpoint.path if result.checkpoint else None,
        "plan": plan,  # what the run set out to do (run/plan.py), stated in its first lines
        "eval_loss": m.get("eval_loss"),  # the held-out loss at the end (--eval-split / --eval-data)
        "trainable_params": m.get("trainable_params"),
        "total_params": m.get("total_params"),
        # where the data time went, per stage, and whether to add data CPUs (run/datatime.py)
        "data_time": summarize_data_time(m.get("data_time"), int(m.get("total_samples", 0)),
                                         float(m.get("total_train_s", 0.0)),
                                         sizes.measure[1] + sizes.materialize[1] + PLAN_CPUS, cfg.train.num_workers),
    }
    filtered = filtered_counts(cfg.data)  # --filter: rows left out at read, not skips
    if filtered:
        summary["filtered"] = sum(filtered.values())
    if cfg.data.sources:  # several datasets: what each trained and skipped (formats/sources.py)
        summary["sources"] = source_summary(cfg, batch_records, skipped_ids)
        for name, n in filtered.items():
            if name in summary["sources"]:
                summary["sources"][name]["filtered"] = n
    if stopped.exists():  # the skip guard stopped the run (train/loop.py)
        summary["stopped"] = _explain_stop(cfg, out, json.loads(stopped.read_text()))
    (out / RunDir.SUMMARY).write_text(json.dumps(summary, indent=2, default=str))
    if summary["data_time"]:
        print(f"[ray_mmbatch] {summary['data_time']['verdict']}", flush=True)
    if stopped.exists():
        raise TooManySkipped(summary["stopped"])
    return summary


def _explain_stop(cfg: Config, out: Path, stop: dict[str, int]) -> str:
    """Why the skip guard stopped the run: its reasons and fixes, from the merged skipped.csv."""
    from ray_mmbatch.run.guards import explain_skips

    with open(out / RunDir.SKIPPED, newline="") as f:
        records = [SkipRecord(r["sample_id"], r["reason"], r["detail"]) for r in csv.DictReader(f)]
    return explain_skips(records, max(int(stop["seen"]), len(records)), cfg.data.max_skip_fraction, cfg.data)


def _final_loss(out: Path) -> float | None:
    rows = read_jsonl(out / RunDir.METRICS)
    return rows[-1]["loss"] if rows else None


def source_summary(cfg: Config, batches: list[dict], skipped: dict[str, tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """``summary.json`` ``sources`` of a multi-source run, per source name: its weight, the samples it
    trained (the batch records' per-source counts) and their share of all trained, and its skips
    (``skipped``: {sample id: (reason, detail)}, as skipped.csv holds them) in all and by reason."""
    from ray_mmbatch.formats.sources import by_source, data_sources

    ids = list(skipped)
    counts = by_source(ids, [skipped[i][0] for i in ids])
    trained: dict[str, int] = {}  # from the batch records, trimmed on a restore as the rest of the run dir
    for rec in batches:
        for name, n in (rec.get("sources") or {}).items():
            trained[name] = trained.get(name, 0) + int(n)
    total = sum(trained.values())
    return {s.name: {"weight": s.weight, "trained": trained.get(s.name, 0),
                     "trained_share": trained.get(s.name, 0) / total if total else None,
                     "skipped": counts.get(s.name, {}).get("skipped", 0),
                     "skipped_by_reason": {k: v for k, v in counts.get(s.name, {}).items()
                                           if k not in ("samples", "skipped")}}
            for s in data_sources(cfg.data)}
