"""Search batch budgets with Ray Tune for the highest real tokens/s under a memory limit.

Prints a results table and writes OUT/best.yaml, which `ray-mmbatch train --config OUT/best.yaml`
takes as it is. Example:

    ray-mmbatch tune --data DATA --max-tokens-grid 2048,4096,8192 --mode-grid pack,pad \\
        --memory-limit-mb 6000 --out runs/tune
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ray_mmbatch.cli import add_config_flags, add_console_flags, config_from_args


def _grid(text: str | None, cast):
    return [cast(x) for x in text.split(",")] if text else None


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    p.add_argument("--out", default="runs/tune", help="where trials, trials.json and best.yaml go")
    p.add_argument("--max-tokens-grid", default="2048,4096,8192", help="comma list of budget.max_tokens")
    p.add_argument("--mode-grid", default="pack", help="comma list of budget.mode (pack,pad)")
    p.add_argument("--window-grid", default=None, help="comma list of budget.window")
    p.add_argument("--max-patches-grid", default=None, help="comma list of budget.max_patches")
    p.add_argument("--memory-limit-mb", type=float, default=8000.0,
                   help="peak memory allowed (GPU memory on GPU, worker RSS on CPU)")
    p.add_argument("--warmup-steps", type=int, default=2, help="steps not measured in each trial")
    p.add_argument("--steps", type=int, default=4, help="measured steps per trial")
    p.add_argument("--metric", default="tokens_per_s", choices=("tokens_per_s", "eval_loss", "final_loss"),
                   help="what picks the best feasible trial (eval_loss: needs --eval-split / --eval-data)")
    add_console_flags(p)
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    from ray_mmbatch.commands.train import ensure_demo_data
    from ray_mmbatch.run.raylogs import quiet_ray

    quiet_ray(args.verbose)
    cfg = config_from_args(args)
    if args.metric == "eval_loss" and not (cfg.data.eval_split or cfg.data.eval_data):
        print("[tune] error: --metric eval_loss needs a held-out set: --eval-split F or --eval-data PATH",
              file=sys.stderr, flush=True)
        return 2
    ensure_demo_data(cfg)  # same demo data as the train command
    from ray_mmbatch.formats.listing import one_listing

    with one_listing():  # the pre-flight and the sweep's trials share one listing of each source
        return _tune(cfg, args)


def _tune(cfg, args) -> int:
    from ray_mmbatch.run.preflight import PreflightError, preflight

    try:
        preflight(cfg)
    except PreflightError as e:
        print(f"[tune] error: {e}", file=sys.stderr, flush=True)
        return 2
    space = {"budget.max_tokens": _grid(args.max_tokens_grid, int), "budget.mode": _grid(args.mode_grid, str)}
    for key, text, cast in (("budget.window", args.window_grid, int),
                            ("budget.max_patches", args.max_patches_grid, int)):
        if text:
            space[key] = _grid(text, cast)
    from ray_mmbatch.run.tune import format_table, grid, tune_budgets

    settings = grid(space)
    print(f"[tune] {len(settings)} trials, {args.warmup_steps}+{args.steps} steps each -> {Path(args.out).resolve()}",
          flush=True)
    from ray_mmbatch.run.cluster import ClusterError

    try:
        res = tune_budgets(cfg, settings, args.out, args.memory_limit_mb, args.warmup_steps, args.steps,
                           verbose=args.verbose, metric=args.metric)
    except ClusterError as e:  # a cluster it may not join: the one-line fix, as train prints it
        print(f"[tune] error: {e}", file=sys.stderr, flush=True)
        return 2
    print(format_table(res["trials"]))
    if res["best"] is None:
        print("no feasible setting: raise --memory-limit-mb or lower the budgets", file=sys.stderr)
        return 1
    print("best:", json.dumps(res["best"]["setting"]), "->", Path(args.out) / "best.yaml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
