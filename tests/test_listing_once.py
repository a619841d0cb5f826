"""One listing per source per run (issue 44), counted on a real S3 server (moto, every request recorded:
tests/s3_counting.py) holding a ``datasets`` save_to_disk folder of 4 shards and a Parquet folder.

- Listing a save_to_disk folder reads its shards' record-batch headers, not the shards: a small share of
  each shard's bytes, and the same read units (and listing digest) as the local copy.
- The driver's steps of a run (pre-flight, the plan's count, the listing digest, --filter's counts, the
  listing summary) list each source's folder once, and fetch each shard's bytes about once (the pre-flight
  reads the first samples), where they were listed at every step before.
- A whole ``train`` run (Ray Train, --filter, two epochs' datasets) lists each source once.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest

from ray_mmbatch.config import Config, DataConfig
from ray_mmbatch.formats.listing import one_listing
from ray_mmbatch.formats.units import listing_digest, read_units

datasets = pytest.importorskip("datasets")
pytest.importorskip("moto.server")
from tests.s3_counting import CountingS3  # noqa: E402  (moto first: skipped without it)

BUCKET = "listing-once"
ROWS, SHARDS = 24, 4


def _png(i: int, side: int = 160) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(i).integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _save_to_disk(root: Path) -> None:
    """24 rows of a 160x160 noise PNG (~77 KB) each, 3 rows a record batch (datasets writes 1,000 at scale),
    in 4 shards of ~460 KB: every batch body is longer than the listing's 64 KiB read."""
    conv = [{"from": "human", "value": "<image>\nWhat is this?"}, {"from": "gpt", "value": "Noise."}]
    ds = datasets.Dataset.from_dict(
        {"id": [f"r{i}" for i in range(ROWS)], "image": [{"bytes": _png(i), "path": None} for i in range(ROWS)],
         "conversations": [conv] * ROWS, "score": [i % 3 for i in range(ROWS)]},
        features=datasets.Features({"id": datasets.Value("string"), "image": datasets.Image(),
                                    "conversations": [{"from": datasets.Value("string"),
                                                       "value": datasets.Value("string")}],
                                    "score": datasets.Value("int64")}))
    mp = pytest.MonkeyPatch()
    mp.setattr(datasets.config, "DEFAULT_MAX_BATCH_SIZE", 3)
    try:
        ds.save_to_disk(str(root), num_shards=SHARDS)
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def bucket(tmp_path_factory):
    """(server, local root, s3 root, {shard key suffix: bytes}): a save_to_disk folder ``sd`` and a Parquet
    folder ``pq`` uploaded. The server listens where conftest pointed AWS_ENDPOINT_URL (Ray workers too)."""
    import boto3

    from ray_mmbatch.synthetic.generate import generate_dataset

    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])
    server = CountingS3(port).start()
    local = tmp_path_factory.mktemp("listing_once")
    _save_to_disk(local / "sd")
    generate_dataset(str(local / "pq"), 12, "parquet", seed=4, shard_size=6, workers=1)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    for dirpath, _, files in os.walk(local):
        for name in files:
            path = Path(dirpath) / name
            client.upload_file(str(path), BUCKET, path.relative_to(local).as_posix())
    shards = {f"sd/{p.name}": p.stat().st_size for p in sorted((local / "sd").glob("data-*.arrow"))}
    assert len(shards) == SHARDS and all(n > 400_000 for n in shards.values())
    yield server, local, f"s3://{BUCKET}", shards
    server.stop()


def _recursive_lists(server: CountingS3, prefix: str) -> int:
    """Full listings of a folder (not the one-key existence checks a root's kind takes)."""
    return sum(1 for r in server.listings(f"prefix={prefix}/") if "max-keys=1&" not in r.query + "&")


def test_a_save_to_disk_folder_is_listed_from_its_batch_headers(bucket):
    """Its units are the local copy's (so is the digest a resume checks), and each shard gave the listing a
    small share of its bytes: the record-batch headers, never the bodies (the old listing streamed each)."""
    server, local, remote, shards = bucket
    here = read_units(str(local / "sd"), DataConfig(path=str(local / "sd")))[0]
    server.clear()
    there = read_units(f"{remote}/sd", DataConfig(path=f"{remote}/sd"))[0]
    def strip(us):
        return [{k: v for k, v in u.items() if k != "path"} for u in us]
    assert strip(there) == strip(here) and listing_digest(there) == listing_digest(here)
    assert sum(u["rows"] for u in there) == ROWS and all(u["offset"] > 0 and u["length"] > 0 for u in there)
    for key, size in shards.items():
        gets = server.gets(key)
        assert gets and all(r.range for r in gets), key  # ranged reads only, no whole-object GET
        assert sum(r.sent for r in gets) < 0.35 * size, (key, [(r.range, r.sent) for r in gets], size)
    assert _recursive_lists(server, "sd") == 1


def test_the_driver_steps_of_a_run_list_each_source_once(bucket):
    """pre-flight, the plan's count, the listing digest, --filter's counts and the listing summary: one full
    listing of each source's folder, and each shard's bytes fetched about once (the pre-flight reads the first
    samples). Without the run's scope (as before) each step lists again: the control."""
    from ray_mmbatch.formats.units import count_samples, filtered_counts, listing_summary
    from ray_mmbatch.run.defaults import resolve_defaults
    from ray_mmbatch.run.preflight import preflight
    from ray_mmbatch.train.trainer import run_plan

    server, _, remote, shards = bucket

    def steps():
        cfg = Config()
        cfg.data = DataConfig(sources=[{"path": f"{remote}/sd", "name": "sd", "filter": "score >= 1"},
                                       {"path": f"{remote}/pq", "name": "pq"}])
        resolve_defaults(cfg)
        seen = preflight(cfg, samples=8)
        plan = run_plan(cfg, seen["tokens_per_sample"], seen["samples_checked"])
        reader = read_units(cfg.data.path, cfg.data)
        listing_digest(reader[0])
        listing_summary(reader, cfg.data)
        assert count_samples(cfg.data.path, cfg.data) == plan["samples_per_epoch"] == 16 + 12
        assert filtered_counts(cfg.data) == {"sd": 8}

    server.clear()
    with one_listing():
        steps()
    assert _recursive_lists(server, "sd") == 1 and _recursive_lists(server, "pq") == 1
    fetched = {key: server.bytes_sent(key) for key in shards}
    assert all(n <= 1.35 * shards[k] for k, n in fetched.items()), (fetched, shards)  # listing + pre-flight
    server.clear()
    steps()  # no scope: every step lists (the old behaviour)
    assert _recursive_lists(server, "sd") >= 4 and _recursive_lists(server, "pq") >= 4
    assert sum(server.bytes_sent(k) for k in shards) > 3 * sum(fetched.values()) / 2


@pytest.mark.ray
@pytest.mark.slow
def test_a_train_run_lists_each_source_once(ray_cluster, bucket, tmp_path):
    """``ray-mmbatch train`` over the bucket with --filter and two epochs: one full listing of the folder for the
    whole run (pre-flight, plan, digest, both epochs' datasets in the Train controller, summary.json's filtered
    count), and each shard's bytes fetched at most a few times (listing with --filter, pre-flight, the epochs'
    reads), where each listing read them whole before."""
    import json

    from ray_mmbatch.commands.train import main

    server, _, remote, shards = bucket
    server.clear()
    out = tmp_path / "run"
    rc = main(["--data", f"{remote}/sd", "--filter", "score >= 1", "--output-dir", str(out), "--epochs", "2",
               "--num-workers", "1", "--max-tokens", "2048", "--window", "16", "--set", "train.max_steps=0"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["filtered"] == 8 and summary["samples"] + summary["skipped_total"] == 2 * 16, summary
    assert _recursive_lists(server, "sd") == 1
    for key, size in shards.items():  # listing (--filter reads the batches) + pre-flight + 2 epochs
        assert server.bytes_sent(key) <= 3.5 * size, (key, server.bytes_sent(key), size)


def test_inspect_throughput_lists_the_folder_once(bucket, tmp_path, capsys):
    """``inspect --throughput`` (in this process: pre-flight, then the stages over the first samples): one
    full listing of the folder, and each shard fetched about once beside its listing (before: 3 listings,
    each streaming every shard)."""
    from ray_mmbatch.commands.inspect_data import main

    server, _, remote, shards = bucket
    server.clear()
    assert main(["--data", f"{remote}/sd", "--throughput", "--throughput-samples", "12", "--max-tokens", "2048",
                 "--json", str(tmp_path / "t.json")]) == 0
    assert _recursive_lists(server, "sd") == 1
    assert all(server.bytes_sent(k) <= 2.5 * n for k, n in shards.items()), \
        {k: server.bytes_sent(k) for k in shards}  # pre-flight + the throughput read


@pytest.mark.ray
def test_inspect_lists_the_folder_once(ray_cluster, bucket, tmp_path, capsys):
    """``inspect`` with --filter: the pre-flight, the listing summary and the Ray read share one listing."""
    import json

    from ray_mmbatch.commands.inspect_data import main

    server, _, remote, _ = bucket
    server.clear()
    assert main(["--data", f"{remote}/sd", "--filter", "score >= 1", "--json", str(tmp_path / "i.json")]) == 0
    summary = json.loads((tmp_path / "i.json").read_text())
    assert summary["samples_read"] == 16, summary
    assert _recursive_lists(server, "sd") == 1


@pytest.mark.ray
@pytest.mark.slow
def test_a_tune_sweep_lists_the_folder_once(ray_cluster, bucket, tmp_path):
    """``tune``: the pre-flight lists the folder, the sweep hands that listing to its trials (Ray workers,
    through the object store): one full listing for the sweep (before: one more in every trial; one trial
    shows it, each trial is a Train run of its own)."""
    from ray_mmbatch.run.preflight import preflight
    from ray_mmbatch.run.tune import tune_budgets

    server, _, remote, _ = bucket
    base = Config()
    base.data = DataConfig(path=f"{remote}/sd")
    base.budget.window = 16
    server.clear()
    with one_listing():
        preflight(base, samples=8)
        res = tune_budgets(base, [{"budget.max_tokens": 2048}], str(tmp_path / "t"),
                           memory_limit_mb=64_000, warmup_steps=0, steps=1, verbose=False)
    assert [t["status"] for t in res["trials"]] == ["ok"], res["trials"]
    assert _recursive_lists(server, "sd") == 1


@pytest.mark.ray
def test_your_own_trainers_epoch_streams_share_one_listing(ray_cluster, bucket):
    """``ingest.datasets(cfg, epochs=3)`` (the streams for a TorchTrainer of your own): one full listing for
    the three epochs (before: one per epoch, each streaming every shard)."""
    from ray_mmbatch.train import ingest

    server, _, remote, shards = bucket
    cfg = Config()
    cfg.data = DataConfig(path=f"{remote}/sd")
    server.clear()
    streams = ingest.datasets(cfg, epochs=3)
    assert len(streams) == 3
    assert _recursive_lists(server, "sd") == 1
    assert sum(server.bytes_sent(k) for k in shards) < 0.35 * sum(shards.values())  # headers only: nothing read yet
