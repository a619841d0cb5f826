"""Train a small vision-language model on token-budget batches with Ray Train.

With no arguments: generates a small demo dataset (if none is there), starts Ray
locally (or joins a running cluster: RAY_ADDRESS, or one started with
``ray start --head``), trains on CPU for a short run and writes
OUTPUT_DIR/summary.json.

With --model CKPT the settings left unset are a fine-tune's, not the demo's: learning
rate 1e-5 (LoRA / QLoRA 1e-4), 3 whole epochs, 10% warm-up, a checkpoint at every
quarter of the run, output in runs/<CKPT's folder name> (ray_mmbatch/run/defaults.py
names each one's source). The run's first lines state its plan.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ray_mmbatch.cli import add_config_flags, add_console_flags, config_from_args


def ensure_demo_data(cfg) -> None:
    """No --data: generate (once) a small dataset next to the run."""
    if cfg.data.path or cfg.data.sources:
        return
    from ray_mmbatch.synthetic.generate import generate_dataset

    demo = Path(cfg.train.output_dir).resolve().parent / "demo_data"
    if not (demo / "manifest.json").exists():
        # one sample of each kind of broken input rides along, to show they are skipped and counted
        print(f"[train] generating {cfg.data.demo_samples} demo samples (+ broken ones) in {demo}", flush=True)
        generate_dataset(str(demo), cfg.data.demo_samples, "parquet", seed=cfg.train.seed, bad_per_kind=1)
    cfg.data.path, cfg.data.format = str(demo), "parquet"


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    add_console_flags(parser)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    from ray_mmbatch.run.raylogs import quiet_ray

    quiet_ray(args.verbose, own_progress=True)
    cfg = config_from_args(args)
    ensure_demo_data(cfg)
    from ray_mmbatch.formats.listing import one_listing

    with one_listing():  # pre-flight, the plan's count, the pipeline and --filter's counts share one listing
        return _train(cfg)


def _train(cfg) -> int:
    from ray_mmbatch.dataflow.pools import ResourceError
    from ray_mmbatch.models.trainable import check_config as check_trainable
    from ray_mmbatch.run.guards import TooManySkipped
    from ray_mmbatch.run.preflight import PreflightError, preflight
    from ray_mmbatch.run.progress import ProgressPrinter, format_summary
    from ray_mmbatch.run.rundir import RunDir
    from ray_mmbatch.run.trackers import TrackerError, check_trackers

    try:
        check_trackers(cfg.train.report_to)  # --report-to: each tracker imports, else the pip install to run
        try:  # --lora-* / --qlora / --freeze that do not go together, or peft missing: one line naming why
            check_trainable(cfg)
        except (ValueError, ImportError) as e:
            raise PreflightError(str(e)) from None
        seen = preflight(cfg)
    except (PreflightError, TrackerError) as e:
        print(f"[train] error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"[train] data ok: {seen['format']}, {seen['files']} file(s), first {seen['samples_checked']} samples "
          f"checked ({seen['skipped']} skipped)", flush=True)
    for line in seen.get("read_as", [])[:20]:
        print(f"[train] read as: {line}", flush=True)
    from ray_mmbatch.run.plan import plan_lines
    from ray_mmbatch.train.trainer import run_plan, run_training

    plan = run_plan(cfg, seen.get("tokens_per_sample"), seen["samples_checked"] - seen["skipped"])  # summary.json
    for line in plan_lines(plan, cfg):
        print(f"[train] {line}", flush=True)

    out = Path(cfg.train.output_dir).resolve()
    print(f"[train] training -> {out} (Ray logs keep everything; --verbose shows them here)", flush=True)
    try:
        with ProgressPrinter(out / RunDir.METRICS, cfg.train.max_steps):
            summary = run_training(cfg, plan=plan)
    except TooManySkipped as e:
        print(f"[train] error: {e}", file=sys.stderr, flush=True)
        return 3
    except ResourceError as e:  # raised before any stream starts (pools.py)
        print(f"[train] error: {e}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:  # the traceback follows; say first where to look further
        print(f"[train] failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}\n"
              f"[train] Ray's logs: /tmp/ray/session_latest/logs (on a cluster, the head node's)",
              file=sys.stderr, flush=True)
        raise
    print("[train] done\n" + format_summary(summary, out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
