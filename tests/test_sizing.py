"""Sizing the data side: docs/cluster.md's rule (run/sizing.py) and `inspect --throughput` on generated data."""
from __future__ import annotations

import json
import math
import re

import pytest

from ray_mmbatch.run.sizing import HEADROOM, data_cpus, format_sizing, supplied


def test_the_rule_and_its_inverse():
    # docs/cluster.md's example: 8 GPUs x 40 samples/s at 170 samples/s per data CPU -> 1.3 x 320 / 170
    assert data_cpus(8, 40, 170) == pytest.approx(1.3 * 8 * 40 / 170) == pytest.approx(2.447, abs=1e-3)
    assert data_cpus(8, 40, 170, headroom=1.0) == pytest.approx(320 / 170)
    assert supplied(data_cpus(64, 25, 150), 150) == pytest.approx(64 * 25)
    assert supplied(2, 130) == pytest.approx(2 * 130 / HEADROOM)
    with pytest.raises(ValueError):
        data_cpus(1, 10, 0)
    result = {"samples": 100, "samples_ok": 90, "mean_tokens": 500.0, "samples_per_cpu_s": 130.0,
              "samples_per_wall_s": 120.0, "path": "p",
              "cpu_ms_per_sample": {"read": 1, "measure": 1, "plan": 0, "materialize": 5, "decode": 0}}
    assert "64 accel." in format_sizing(result)  # no accelerators given: the table
    assert "-> 6.40 data CPUs, i.e. 7" in format_sizing(result, 64, 10)


def test_inspect_throughput_prints_the_per_cpu_figure_and_the_cpus_for_the_accelerators(tmp_path, capsys):
    """The real command, no Ray: 120 generated samples through read -> measure -> plan -> materialize."""
    from ray_mmbatch.commands import inspect_data
    from ray_mmbatch.synthetic.generate import generate_dataset

    generate_dataset(str(tmp_path / "d"), 120, "parquet", seed=4, shard_size=60, workers=1)
    rc = inspect_data.main(["--data", str(tmp_path / "d"), "--throughput", "--throughput-samples", "80",
                            "--accelerators", "8", "--samples-per-accelerator", "25", "--window", "32",
                            "--json", str(tmp_path / "t.json")])
    assert rc == 0
    out = capsys.readouterr().out
    r = json.loads((tmp_path / "t.json").read_text())
    assert r["samples"] == 80 and r["batches"] > 1 and r["samples_per_cpu_s"] > 0 and r["mean_tokens"] > 0
    per_cpu = float(re.search(r"per data CPU  ([\d,.]+) samples/s", out)[1].replace(",", ""))
    assert per_cpu == pytest.approx(r["samples_per_cpu_s"], abs=0.051)
    need = data_cpus(8, 25, r["samples_per_cpu_s"])
    assert f"8 accelerator(s) x 25.0 samples/s each -> {need:.2f} data CPUs, i.e. {math.ceil(need)}" in out


def test_inspect_throughput_prepares_the_samples_for_the_model(tmp_path, capsys):
    """--throughput --model: the samples go through the checkpoint's tokenizer and image processor (its mean
    tokens are the checkpoint's, not the built-in model's), and the report names the family."""
    from ray_mmbatch.commands import inspect_data
    from ray_mmbatch.synthetic.generate import generate_dataset
    from tests.hf_checkpoints import make_qwen_checkpoint

    generate_dataset(str(tmp_path / "d"), 60, "parquet", seed=4, shard_size=60, workers=1)
    ckpt = make_qwen_checkpoint(tmp_path / "qwen", "qwen2_vl")  # at most 64 tokens an image
    means = {}
    for name, extra in (("builtin", []), ("qwen2_vl", ["--model", str(ckpt)])):
        assert inspect_data.main(["--data", str(tmp_path / "d"), "--throughput", "--throughput-samples", "40",
                                  "--json", str(tmp_path / f"{name}.json")] + extra) == 0
        report = json.loads((tmp_path / f"{name}.json").read_text())
        assert report["model"]["model_type"] == ("the built-in model" if name == "builtin" else name)
        means[name] = report["mean_tokens"]
    assert "prepared for qwen2_vl (qwen_vl backend)" in capsys.readouterr().out
    assert means["qwen2_vl"] < means["builtin"]
