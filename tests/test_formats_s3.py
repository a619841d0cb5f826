"""Data in an object store: the three formats read from s3:// (a real S3-compatible HTTP server on
127.0.0.1, moto) give the same sample ids and token counts as the local copy."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from ray_mmbatch import schema as S
from ray_mmbatch.config import DataConfig, ImageConfig, TextConfig
from ray_mmbatch.data.measure import measure_batch
from ray_mmbatch.data.text.encoder import tokenizer_for
from ray_mmbatch.formats.fs import DataLocationError
from ray_mmbatch.formats.units import count_samples, read_units
from ray_mmbatch.run.rundir import RunDir
from ray_mmbatch.synthetic.generate import generate_dataset

moto_server = pytest.importorskip("moto.server")
BUCKET = "vlm-data"
SETS = {"parquet": ("parquet", "conversations"), "caption": ("parquet", "caption"),
        "webdataset": ("webdataset", "conversations"), "llava": ("llava", "conversations")}
CAPTION_CFG = dict(image_column="image", text_column="text", id_column="key")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """(local root, s3 root): the generated sets, uploaded. The server listens where conftest pointed
    AWS_ENDPOINT_URL (set before any Ray worker started, so the workers reach it too)."""
    import boto3

    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])  # conftest.S3_PORT
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    local = tmp_path_factory.mktemp("s3src")
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    for key, (fmt, style) in SETS.items():
        generate_dataset(str(local / key), 24, fmt, seed=3, shard_size=10, workers=1, parquet_style=style)
        for dirpath, _, files in os.walk(local / key):
            for name in files:
                path = Path(dirpath) / name
                client.upload_file(str(path), BUCKET, f"sets/{path.relative_to(local).as_posix()}")
    yield local, f"s3://{BUCKET}/sets"
    server.stop()


def _cfg(path: str, key: str) -> DataConfig:
    return DataConfig(path=path, **(CAPTION_CFG if key == "caption" else {}))


def _measured(path: str, key: str) -> dict[str, tuple]:
    """In-process read (readers.read_units, the Ray read's own functions) + measure: id -> costs."""
    cfg = _cfg(path, key)
    units, read_fn, kwargs = read_units(path, cfg)
    tok = tokenizer_for(TextConfig())
    out = {}
    for unit in units:
        raw = read_fn(pa.Table.from_pylist([dict(unit, end=False)]), **kwargs).to_pydict()
        m = measure_batch(raw, ImageConfig(), tok, TextConfig())
        for i, sid in enumerate(m[S.SAMPLE_ID]):
            out[sid] = (int(m[S.TOKENS][i]), int(m[S.PATCHES][i]), str(m[S.SKIP_REASON][i]).split(":")[0])
    return out


@pytest.mark.parametrize("key", list(SETS))
def test_s3_reads_the_same_samples_and_tokens_as_local(s3, key):
    local, remote = s3
    here, there = _measured(str(local / key), key), _measured(f"{remote}/{key}", key)
    assert list(there) == list(here) and len(here) >= 24  # same ids, same order
    assert there == here
    assert sum(t for t, _, r in here.values() if not r) > 1000
    assert count_samples(f"{remote}/{key}", _cfg("", key)) == len(here)


def test_missing_bucket_or_prefix_fails_at_start_naming_the_uri(s3):
    _, remote = s3
    for uri in (f"s3://no-such-bucket-{os.getpid()}/x", f"{remote}/nothing-here"):
        with pytest.raises(DataLocationError, match=uri.replace("/", ".")):
            read_units(uri, DataConfig())


def test_missing_object_is_a_skipped_sample(s3):
    import boto3

    local, remote = s3
    images = sorted(p for p in (local / "llava" / "images").rglob("*") if p.is_file())
    gone = images[0].relative_to(local).as_posix()
    boto3.client("s3").delete_object(Bucket=BUCKET, Key=f"sets/{gone}")
    try:
        there = _measured(f"{remote}/llava", "llava")
    finally:
        boto3.client("s3").upload_file(str(images[0]), BUCKET, f"sets/{gone}")
    here = _measured(str(local / "llava"), "llava")
    lost = [sid for sid, (_, _, r) in there.items() if r]
    assert len(lost) == 1 and there[lost[0]][2] == S.SKIP_MISSING_FILE and here[lost[0]][2] == ""
    assert {k: v for k, v in there.items() if k not in lost} == {k: v for k, v in here.items() if k not in lost}


@pytest.mark.ray
def test_ray_read_from_s3_equals_local(ray_cluster, s3):
    from ray_mmbatch.dataflow.read import read_raw

    local, remote = s3
    ray_cluster.data.DataContext.get_current().execution_options.preserve_order = True
    rows = read_raw(f"{remote}/webdataset", DataConfig(), override_num_blocks=3).take_all()
    ids = [r[S.SAMPLE_ID] for r in rows]
    assert ids == list(_measured(str(local / "webdataset"), "webdataset"))
    assert all(r[S.READ_ERROR] == "" for r in rows) and sum(len(r[S.IMAGES]) for r in rows) > 10
    assert np.all([isinstance(b, bytes) for r in rows for b in r[S.IMAGES]])


def test_preflight_and_image_root_in_the_bucket(s3):
    from ray_mmbatch.config import Config
    from ray_mmbatch.run.preflight import PreflightError, preflight

    _, remote = s3
    cfg = Config()
    cfg.data = DataConfig(path=f"{remote}/llava/data.json", image_root=f"{remote}/llava")
    seen = preflight(cfg, samples=8)
    assert seen["format"] == "llava" and seen["samples_checked"] == 8 and seen["skipped"] == 0
    cfg.data.image_root = f"{remote}/no-images-here"
    with pytest.raises(PreflightError, match="not a folder"):
        preflight(cfg, samples=8)


@pytest.mark.ray
def test_inspect_from_s3_equals_local(ray_cluster, s3):
    from ray_mmbatch.config import Config
    from ray_mmbatch.dataflow.inspection import inspect_dataset

    local, remote = s3
    summaries = []
    for path in (str(local / "parquet"), f"{remote}/parquet"):
        cfg = Config()
        cfg.data = DataConfig(path=path)
        summaries.append(inspect_dataset(cfg))
    here, there = summaries
    for key in ("samples_read", "samples_ok", "skipped", "skipped_files", "tokens", "image_tokens", "patches"):
        assert there[key] == here[key], key
    assert here["samples_ok"] == 24


def test_file_uri_is_the_local_path(s3):
    local, _ = s3
    a = _measured(str(local / "webdataset"), "webdataset")
    assert _measured(f"file://{local / 'webdataset'}", "webdataset") == a


@pytest.mark.ray
@pytest.mark.slow
def test_short_train_from_s3_trains_every_sample_of_the_local_copy(ray_cluster, s3, tmp_path):
    import csv
    import json

    import pyarrow.fs as pafs

    from ray_mmbatch.config import Config
    from ray_mmbatch.formats import fs
    from ray_mmbatch.train.checkpoint import read_latest_position
    from ray_mmbatch.train.trainer import run_training

    local, remote = s3
    cfg = Config()
    cfg.data = DataConfig(path=f"{remote}/parquet")
    cfg.budget.max_tokens, cfg.budget.window = 2048, 16
    cfg.train.output_dir, cfg.train.ledger, cfg.train.max_steps = str(tmp_path / "run"), True, 0
    cfg.train.storage = f"s3://{BUCKET}/ckpts"  # checkpoints in the bucket, logs in the local folder
    summary = run_training(cfg)
    out = tmp_path / "run"
    # the checkpoints went to the bucket, and a resume reads its data position from there
    bucket, path = fs.split(f"{cfg.train.storage}/run")
    stored = [i.path for i in bucket.get_file_info(pafs.FileSelector(path, recursive=True))]
    assert any(p.endswith("/state.json") for p in stored) and not (out / "ray_storage").exists(), stored
    # rank 0's export (written on its node) is published beside them, where `ray down` does not take it
    assert {f"{path}/{RunDir.EXPORT}/model.pt", f"{path}/{RunDir.EXPORT}/config.yaml"} <= set(stored), stored
    position = read_latest_position(tmp_path / "nowhere", f"{cfg.train.storage}/run")
    assert position is not None and position["epochs"], position
    trained = [sid for p in sorted((out / RunDir.LEDGER).glob("rank*.jsonl"))
               for line in p.read_text().splitlines() for sid in json.loads(line)["sample_ids"]]
    with open(out / RunDir.SKIPPED) as f:
        skipped = [r["sample_id"] for r in csv.DictReader(f)]
    assert sorted(trained + skipped) == sorted(_measured(str(local / "parquet"), "parquet"))
    assert len(set(trained)) == len(trained) == summary["samples"] >= 24 - len(skipped)


def test_access_denied_fails_at_start_naming_the_uri(s3, monkeypatch):
    """The server starts checking keys (moto's IAM auth): ours are unknown to it, so listing is refused."""
    from moto import settings

    _, remote = s3
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    with pytest.raises(DataLocationError, match=f"{remote}/parquet".replace("/", ".")) as err:
        read_units(f"{remote}/parquet", DataConfig())
    assert "cannot read" in str(err.value) and "ACCESS_DENIED" in str(err.value).upper().replace(" ", "_")


def test_output_dir_uri_or_missing_storage_bucket_fail_at_start(s3):
    """--output-dir is a folder: a URI there is refused with the fix named; a --storage bucket that
    does not exist fails before any worker starts, naming it."""
    from ray_mmbatch.config import Config
    from ray_mmbatch.train.trainer import check_output_locations

    cfg = Config()
    cfg.train.output_dir = f"s3://{BUCKET}/runs/a"
    with pytest.raises(ValueError, match=r"--storage s3://vlm-data/runs/a/ray_storage"):
        check_output_locations(cfg)
    cfg.train.output_dir, cfg.train.storage = "runs/a", "s3://no-such-bucket-here/ckpts"
    with pytest.raises(DataLocationError, match="no-such-bucket-here"):
        check_output_locations(cfg)
    cfg.train.storage = f"s3://{BUCKET}/ckpts"
    check_output_locations(cfg)  # an existing bucket passes


def test_a_video_in_the_bucket_is_read_as_a_local_one(s3, tmp_path):
    """A LLaVA-Video record whose clip lies in the bucket: the same bytes and placeholder as from the local copy."""
    import json

    import boto3

    from ray_mmbatch.synthetic.video import clip_frames, encode_clip

    _, remote = s3
    clip = encode_clip(clip_frames(6, 32, 48), fps=6)
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "c.mp4").write_bytes(clip)
    (tmp_path / "data.json").write_text(json.dumps([{"id": "v", "video": "clips/c.mp4", "conversations": [
        {"from": "human", "value": "<video>\nWhat moves?"}, {"from": "gpt", "value": "A square."}]}]))
    client = boto3.client("s3")
    for name in ("clips/c.mp4", "data.json"):
        client.upload_file(str(tmp_path / name), BUCKET, f"video/{name}")
    rows = {}
    for where in (str(tmp_path), f"{remote.rsplit('/', 1)[0]}/video"):
        units, read_fn, kwargs = read_units(f"{where}/data.json", DataConfig(path=f"{where}/data.json"))
        (row,) = read_fn(pa.Table.from_pylist([dict(units[0], end=False)]), **kwargs).to_pylist()
        rows[where.startswith("s3")] = row
    for row in rows.values():
        assert row[S.READ_ERROR] == "" and row[S.IMAGES] == [clip] and "<video>" in row[S.CONVERSATIONS]
    assert rows[True][S.CONVERSATIONS] == rows[False][S.CONVERSATIONS]
