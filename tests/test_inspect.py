"""The data check over a LLaVA dataset with every kind of bad sample: counts add up, every
bad sample is reported with its reason, and materialize matches measure for every good one."""
from __future__ import annotations

import pytest

from ray_mmbatch.config import Config
from ray_mmbatch.synthetic.generate import generate_dataset

pytestmark = pytest.mark.ray


def test_inspect_llava_with_bad_samples(ray_cluster, tmp_path):
    from ray_mmbatch.dataflow.inspection import inspect_dataset

    manifest = generate_dataset(str(tmp_path / "llava"), 120, "llava", seed=5, shard_size=40, bad_per_kind=1)
    assert len({r for r in manifest["bad"].values()}) >= 10
    cfg = Config()
    cfg.data.path, cfg.data.format = str(tmp_path / "llava"), "llava"
    s = inspect_dataset(cfg)
    assert s["samples_read"] == len(manifest["ids"])
    assert s["samples_ok"] + s["samples_skipped"] == s["samples_read"]
    assert s["length_mismatch"] == 0
    expected: dict[str, int] = {}
    for sid, reason in manifest["bad"].items():
        if sid not in manifest["bad_conditions"]:   # too_many_images is valid without an image budget
            expected[reason] = expected.get(reason, 0) + 1
    assert s["skipped"] == expected
    for reason, ids in s["skipped_examples"].items():
        assert all(manifest["bad"][i] == reason for i in ids)
    assert s["samples_ok"] == len(manifest["ids"]) - sum(expected.values())
    assert s["tokens"]["max"] >= s["tokens"]["p50"] > 0
    assert s["image_tokens"]["max"] > 0 and s["patches"]["max"] > 0
    assert set(s["images_per_sample"]) >= {"0", "1"}
    assert s["samples_per_s"] > 0
