#!/usr/bin/env python
"""Train a small vision-language model on token-budget batches with Ray Train.

With no arguments: generates a small demo dataset (if none is there), starts Ray
locally (or joins a running cluster: RAY_ADDRESS, or one started with
``ray start --head``), trains on CPU for a short run and writes
OUTPUT_DIR/summary.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray_mmbatch.cli import add_config_flags, config_from_args  # noqa: E402


def ensure_demo_data(cfg) -> None:
    """No --data: generate (once) a small dataset next to the run."""
    if cfg.data.path:
        return
    from ray_mmbatch.data.generate import generate_dataset

    demo = Path(cfg.train.output_dir).resolve().parent / "demo_data"
    if not (demo / "manifest.json").exists():
        # one sample of each kind of broken input rides along, to show they are skipped and counted
        print(f"[train] generating {cfg.data.demo_samples} demo samples (+ broken ones) in {demo}", flush=True)
        generate_dataset(str(demo), cfg.data.demo_samples, "parquet", seed=cfg.train.seed, bad_per_kind=1)
    cfg.data.path, cfg.data.format = str(demo), "parquet"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    ensure_demo_data(cfg)
    from ray_mmbatch.train.trainer import run_training

    summary = run_training(cfg)
    short = {k: summary[k] for k in ("steps", "samples", "real_tokens", "padded_tokens", "fill", "tokens_per_s",
                                     "initial_loss", "final_loss", "skipped", "wall_s")}
    print(json.dumps(short, indent=2, default=str))
    print(f"[train] summary written to {Path(cfg.train.output_dir) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
