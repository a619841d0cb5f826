"""``--model s3://...``: a checkpoint in a bucket is copied once per node into the local cache
(formats/fetch.py), and configure, the tokenizer, the model load and the data path read it there
while the config keeps the URI. Against a real S3-compatible HTTP server on 127.0.0.1 (moto)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from ray_mmbatch.config import Config
from ray_mmbatch.formats import fetch

moto_server = pytest.importorskip("moto.server")
BUCKET = "vlm-models"
URI = f"s3://{BUCKET}/ckpt/qwen2-vl-tiny"


@pytest.fixture(scope="module")
def bucket_checkpoint(tmp_path_factory):
    """(local checkpoint dir, its s3:// URI). The server listens where conftest pointed AWS_ENDPOINT_URL."""
    import boto3

    from tests.hf_checkpoints import make_qwen_checkpoint

    port = int(os.environ["AWS_ENDPOINT_URL"].rsplit(":", 1)[1])  # conftest.S3_PORT
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    local = make_qwen_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2-vl-tiny", "qwen2_vl")
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    for path in sorted(local.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"ckpt/qwen2-vl-tiny/{path.relative_to(local).as_posix()}")
    yield local, URI
    server.stop()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(fetch.CACHE_ENV, str(tmp_path / "cache"))
    return tmp_path / "cache"


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*")
            if p.is_file() and p.name != fetch.COMPLETE}


def test_a_bucket_checkpoint_is_fetched_once_per_node_and_a_local_path_is_left_alone(bucket_checkpoint, cache,
                                                                                    monkeypatch):
    local, uri = bucket_checkpoint
    assert fetch.local_checkpoint(str(local)) == str(local) and fetch.local_checkpoint("") == ""
    downloads = []
    real = fetch._download
    monkeypatch.setattr(fetch, "_download", lambda u, t: (downloads.append(u), real(u, t)))
    # several processes of a node at once (threads here): one copy lands, every caller gets it
    got = []
    threads = [threading.Thread(target=lambda: got.append(fetch.local_checkpoint(uri))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 1 and Path(got[0]).parent == cache
    assert _files(Path(got[0])) == _files(local)  # every file, byte for byte
    assert sorted(os.listdir(cache)) == [Path(got[0]).name], "a temporary copy was left behind"
    n = len(downloads)
    assert 1 <= n <= 4
    assert fetch.local_checkpoint(uri + "/") == got[0]  # complete: no download, the same folder
    assert len(downloads) == n
    with pytest.raises(FileNotFoundError, match="no checkpoint files there"):
        fetch.local_checkpoint(f"s3://{BUCKET}/ckpt/missing")


def test_configure_token_ids_and_the_data_path_read_the_bucket_checkpoint(bucket_checkpoint, cache, tmp_path):
    from ray_mmbatch import hf, local_batches
    from ray_mmbatch.models import configure, token_ids
    from ray_mmbatch.synthetic.generate import generate_dataset

    local, uri = bucket_checkpoint
    by_path = configure(_with_model(str(local)))
    by_uri = configure(_with_model(uri))
    assert by_uri.model.path == uri and by_uri.text.tokenizer == uri  # the URI travels to every node
    assert by_uri.image == by_path.image and by_uri.text.image_token == by_path.text.image_token
    assert token_ids(by_uri) == token_ids(by_path)
    assert configure(by_uri).image == by_path.image  # idempotent on the URI

    generate_dataset(str(tmp_path / "d"), 8, "parquet", seed=2, workers=1)
    batches = {}
    for name, cfg in (("path", _with_model(str(local))), ("uri", _with_model(uri))):
        cfg.data.path, cfg.data.format = str(tmp_path / "d"), "parquet"
        batches[name] = next(iter(local_batches(cfg, limit=1)))
    assert batches["uri"].keys() == batches["path"].keys()
    for key, value in batches["path"].items():  # token ids, pixels, positions: the same batch
        assert np.array_equal(np.asarray(batches["uri"][key]), np.asarray(value)), key
    model = hf.load_model(uri)  # a Train worker's load: its node's copy
    assert model.hf_model.config.model_type == "qwen2_vl"


def _with_model(path: str) -> Config:
    cfg = Config()
    cfg.model.path = path
    return cfg


def test_an_export_published_to_the_bucket_is_the_next_runs_model(bucket_checkpoint, cache, tmp_path):
    """Rank 0's export (OUTPUT_DIR/model on its node) copied beside the run's checkpoints in --storage, where
    `ray down` does not take it, and read back through --model s3://... ."""
    from ray_mmbatch.run.rundir import RunDir
    from ray_mmbatch.train.checkpoint import publish_export

    local, _ = bucket_checkpoint
    out = tmp_path / "run"
    (out / RunDir.EXPORT).mkdir(parents=True)
    for name, data in _files(local).items():
        (out / RunDir.EXPORT / name).parent.mkdir(parents=True, exist_ok=True)
        (out / RunDir.EXPORT / name).write_bytes(data)
    assert publish_export(out, "", "run1") == []  # no --storage: the export is where the checkpoints are
    written = publish_export(out, f"s3://{BUCKET}/runs", "run1")
    assert written == [f"s3://{BUCKET}/runs/run1/model"]
    assert _files(Path(fetch.local_checkpoint(written[0]))) == _files(local)
    shared = tmp_path / "shared"
    assert publish_export(out, str(shared), "run1") == [str(shared / "run1" / "model")]
    assert _files(shared / "run1" / "model") == _files(local)
