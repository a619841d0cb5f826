"""The jobs' flags: every flag sets a config field, flags override --config, --help explains."""
from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ray_mmbatch.cli import FLAGS, add_config_flags, config_from_args
from ray_mmbatch.config import Config, load_config, save_config

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv):
    p = argparse.ArgumentParser()
    add_config_flags(p)
    return config_from_args(p.parse_args(argv))


def test_flags_override_the_yaml_file(tmp_path):
    cfg = Config()
    cfg.budget.max_tokens, cfg.budget.mode, cfg.train.num_workers = 8192, "pad", 3
    save_config(cfg, tmp_path / "best.yaml")
    got = _parse(["--config", str(tmp_path / "best.yaml"), "--max-tokens", "2048", "--use-gpu",
                  "--max-patches", "100", "--set", "model.mlp_ratio=2"])
    assert got.budget.max_tokens == 2048          # flag wins
    assert got.budget.mode == "pad" and got.train.num_workers == 3   # file kept
    assert got.train.use_gpu is True and got.budget.max_patches == 100 and got.model.mlp_ratio == 2.0
    assert load_config(tmp_path / "best.yaml").budget.max_tokens == 8192


def test_every_flag_names_a_real_field_and_typos_fail():
    fields = {f"{s}.{k}" for s, sub in Config().to_dict().items() for k in sub}
    assert set(FLAGS.values()) <= fields
    with pytest.raises(KeyError, match="budget"):
        _parse(["--set", "budget.max_tokenz=5"])


def test_train_help_lists_the_documented_options():
    out = subprocess.run([sys.executable, str(ROOT / "jobs" / "train.py"), "--help"], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    for flag in ("--data", "--format", "--mode", "--max-tokens", "--max-patches", "--max-images", "--window",
                 "--d-model", "--num-workers", "--use-gpu", "--max-steps", "--epochs", "--output-dir",
                 "--tokenizer", "--config"):
        assert flag in out
    assert "Token budget per batch" in out   # help text comes from the config field's docstring
