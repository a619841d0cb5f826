"""jobs/verify_packing.py and ray_mmbatch.local_batches on a tiny random Qwen2-VL checkpoint.

The job runs the real data path in-process (local_batches: read, measure through the
checkpoint's chat template, plan, decode, collate) and compares every target token's loss
in the planned batch with the same sample alone; a model fed the naive way (positions not
restarting per sample, so attention leaks across samples) must be flagged.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from ray_mmbatch.batching.collate import collate_pack, collate_pad
from ray_mmbatch.batching.layout import split_batch
from ray_mmbatch.synthetic.generate import generate_dataset
from tests.hf_checkpoints import make_qwen_checkpoint


@pytest.fixture(scope="module")
def qwen_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify")
    ck = make_qwen_checkpoint(root / "ck", "qwen2_vl")
    generate_dataset(str(root / "data"), 36, "parquet", seed=5, shard_size=36)
    return ck, root / "data"


@pytest.mark.parametrize("mode", ["pack", "pad"])
def test_verify_packing_job_passes_on_a_real_checkpoint(qwen_run, mode, capsys):
    import jobs.verify_packing as job

    ck, data = qwen_run
    rc = job.main(["--model", str(ck), "--data", str(data), "--mode", mode, "--max-tokens", "2048",
                   "--batches", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 0, report
    assert report["ok"] and report["mode"] == [mode]
    assert report["batches"] == 2 and report["target_tokens"] > 100
    assert report["max_abs_diff"] < 1e-4
    if mode == "pack":
        assert report["samples"] > 2  # a real pack, not one sample per batch


def test_verify_flags_a_feed_that_leaks_across_samples(qwen_run):
    """Positions that do not restart per sample: HF sees one long sequence, attention crosses samples."""
    import torch

    from ray_mmbatch import hf, local_batches
    from ray_mmbatch.models import token_ids
    from ray_mmbatch.run.verify import verify

    ck, data = qwen_run
    cfg = hf.config_from_checkpoint(str(ck))
    cfg.data.path, cfg.budget.max_tokens = str(data), 2048
    model = hf.load_model(str(ck))
    good = model._adapter

    def leaky(batch):
        kwargs = good(batch)
        if "position_ids" in kwargs and batch["mode"] == "pack":
            pos = kwargs["position_ids"].clone()
            pos[0] = torch.arange(pos.shape[-1])  # text positions run on: no sample boundary left
            kwargs["position_ids"] = pos
        return kwargs

    model._adapter = leaky
    report = verify(model, local_batches(cfg, limit=2), token_ids(cfg)["pad_id"])
    assert not report["ok"] and report["max_abs_diff"] > 0.05, report


def test_local_batches_cover_every_sample_once_within_budget(qwen_run):
    from ray_mmbatch import hf, local_batches

    ck, data = qwen_run
    cfg = hf.config_from_checkpoint(str(ck))
    cfg.data.path, cfg.budget.max_tokens = str(data), 1024
    seen, skipped = [], []
    for item in local_batches(cfg, with_skips=True):
        if "skipped" in item:
            skipped += [s.sample_id for s in item["skipped"]]
            continue
        seen += list(item["sample_ids"])
        assert item["input_ids"].shape == (1, int(item["real_tokens"]))
        assert int(item["real_tokens"]) <= 1024
    assert len(seen) == len(set(seen)) and not set(seen) & set(skipped)
    assert len(seen) + len(skipped) == 36


@pytest.mark.parametrize("collate", [collate_pack, collate_pad])
def test_split_batch_inverts_collate(collate):
    rng = np.random.default_rng(0)
    samples = []
    for i, (n, grids) in enumerate([(7, []), (12, [[1, 2, 4]]), (5, [[1, 2, 2], [1, 4, 2]])]):
        labels = rng.integers(0, 50, n).astype(np.int32)
        labels[-1] = -100
        p = int(sum(np.prod(g) for g in grids))
        samples.append({"sample_id": f"s{i}", "input_ids": rng.integers(0, 50, n).astype(np.int32),
                        "labels": labels, "patches": rng.integers(0, 255, (p, 12)).astype(np.uint8),
                        "grids": np.array(grids, np.int32).reshape(-1, 3)})
    batch = collate(samples, pad_id=0)
    back = split_batch(batch)
    assert [s["sample_id"] for s in back] == ["s0", "s1", "s2"]
    for a, b in zip(samples, back):
        for key in ("input_ids", "labels", "patches", "grids"):
            np.testing.assert_array_equal(a[key], b[key])
    again = collate(back, pad_id=0)
    for key in ("input_ids", "labels", "patches", "image_grid_thw", "position_ids"):
        np.testing.assert_array_equal(batch[key], again[key])
