"""Data check before spending GPU time: read -> measure (-> decode, --decode) every sample with
Ray Data and print a JSON summary (counts, skip reasons with example ids, token / image
token / patch percentiles, images per sample, throughput), measured with the model a run
trains: --model CKPT (or --set model.path=CKPT) configures it exactly as `train` does (the checkpoint's
tokenizer, chat template, image and video processor), so the figures are the ones `train` plans with.
It ends with suggested budgets (--max-tokens; --max-frames with video), each with the samples that would
be oversize at that value:

    ray-mmbatch inspect --model /ckpt/Qwen2.5-VL-3B-Instruct --data DATA

--throughput sizes the data side instead: the first --throughput-samples samples go through the
training path's stages (read -> measure -> plan -> materialize) in this one process, timed in CPU
seconds, and it prints samples/s per data CPU and the data CPUs that --accelerators at
--samples-per-accelerator (or --tokens-per-accelerator) each need (docs/cluster.md's rule):

    ray-mmbatch inspect --data DATA --throughput --accelerators 8 --tokens-per-accelerator 4000
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ray_mmbatch.cli import add_config_flags, add_console_flags, config_from_args


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser, only=("data", "text", "image", "budget", "model.path", "model.backend"))
    parser.add_argument("--json", metavar="PATH", help="also write the summary here")
    parser.add_argument("--decode", choices=("auto", "on", "off"), default="auto",
                        help="decode every image too (finds corrupt pixel data; checks materialized lengths): "
                             "'auto' = on up to 50,000 samples, headers only above (default: auto)")
    parser.add_argument("--progress-every", type=float, default=5.0, metavar="SECONDS",
                        help="when stderr is not a terminal (a log), one progress line every this many seconds "
                             "(default: 5); on a terminal the line is redrawn in place")
    sizing = parser.add_argument_group("sizing the data side (--throughput)")
    sizing.add_argument("--throughput", action="store_true",
                        help="measure samples/s per data CPU on the first --throughput-samples samples through "
                             "the real stages (materialize included) and print the data CPUs N accelerators need, "
                             "instead of the full data check")
    sizing.add_argument("--throughput-samples", type=int, default=2000, metavar="N",
                        help="samples to measure (default: 2000)")
    sizing.add_argument("--accelerators", type=int, default=None, metavar="N",
                        help="accelerators (GPUs) to feed; without it (or a rate) a table for 1 / 8 / 64")
    sizing.add_argument("--samples-per-accelerator", type=float, default=None, metavar="R",
                        help="samples/s one accelerator trains")
    sizing.add_argument("--tokens-per-accelerator", type=float, default=None, metavar="T",
                        help="real tokens/s one accelerator trains (the progress line's tok/s); divided by "
                             "the measured mean tokens per sample")
    add_console_flags(parser)
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    cfg = config_from_args(args)
    if not (cfg.data.path or cfg.data.sources):
        parser.error("--data is required")
    from ray_mmbatch.formats.listing import one_listing

    with one_listing():  # the pre-flight and the read share one listing of each source
        return _inspect(cfg, args)


def _configure_and_check(cfg):
    """(the run's config, configured as ``train`` configures it, a warning or ""), after the pre-flight;
    PreflightError as it raises it."""
    from ray_mmbatch.run.preflight import TooManySkippedAtStart, configure_run, preflight

    cfg = configure_run(cfg)  # the model's tokenizer, template and processors: train's figures, not the demo's
    try:
        preflight(cfg)
    except TooManySkippedAtStart as e:  # inspect still reads it all: a mostly skipped set is what it is for
        return cfg, str(e).replace("stopping instead of training on the rest", "a training run would stop")
    return cfg, ""


def _paths_there(cfg) -> bool:
    """The model and data paths exist (URIs are taken as there): only then does Ray start beside the checks,
    so a mistyped path still fails at once, without a cluster start."""
    import os

    from ray_mmbatch.formats import fs

    paths = [p for p in (cfg.model.path, cfg.data.path) if p and not fs.is_uri(p)]
    return all(os.path.exists(fs.local_path(p)) for p in paths)


def _inspect(cfg, args) -> int:
    from ray_mmbatch.run.preflight import PreflightError
    from ray_mmbatch.run.raylogs import quiet_ray

    tty = sys.stderr.isatty()
    if not args.throughput:  # --throughput runs in this process: no Ray
        quiet_ray(args.verbose, own_progress=True)
    cluster_error = None
    try:
        if args.throughput or not _paths_there(cfg):
            cfg, warning = _configure_and_check(cfg)
        else:  # Ray's start (seconds of its own processes) beside loading the model and the pre-flight's reads
            cfg, warning, cluster_error = _checks_beside_connect(cfg)
    except PreflightError as e:
        print(f"[inspect] error: {e}", file=sys.stderr, flush=True)
        return 2
    if args.throughput:
        return _throughput(cfg, args)
    from ray_mmbatch.dataflow.inspection import inspect_dataset
    from ray_mmbatch.run.cluster import ClusterError
    from ray_mmbatch.run.progress import Progress
    from ray_mmbatch.train.trainer import connect

    try:
        if cluster_error is not None:
            raise cluster_error
        connect()
    except ClusterError as e:  # a cluster it may not join: the one-line fix, as train prints it
        print(f"[inspect] error: {e}", file=sys.stderr, flush=True)
        return 2
    # on stderr: stdout is the JSON summary. Its terminal test from before quiet_ray piped fd 2
    with Progress("inspect", stream=sys.stderr, tty=tty, log_every_s=args.progress_every) as meter:
        summary = inspect_dataset(cfg, args.decode, progress=meter)
    summary = {"model": model_summary(cfg), **summary}
    text = json.dumps(summary, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if summary.get("suggested_budgets"):
        from ray_mmbatch.batching.suggest import format_suggestions

        lines = format_suggestions(summary["suggested_budgets"], summary["samples_ok"]).splitlines()
        print("\n".join(f"[inspect] suggested: {line}" for line in lines), file=sys.stderr, flush=True)
    if warning:
        print(f"[inspect] warning: {warning}", file=sys.stderr, flush=True)
    return 0


def _checks_beside_connect(cfg):
    """``_configure_and_check`` in a thread (in this context: the run's one listing is shared) while this
    thread starts or joins Ray (its signal handlers want the main thread); (cfg, warning, the ClusterError
    or None). The checks' error wins: it is reported first, as when they ran alone."""
    import contextvars
    from concurrent.futures import ThreadPoolExecutor

    from ray_mmbatch.run.cluster import ClusterError
    from ray_mmbatch.train.trainer import connect

    ctx = contextvars.copy_context()
    with ThreadPoolExecutor(1, thread_name_prefix="inspect-checks") as pool:
        checks = pool.submit(ctx.run, _configure_and_check, cfg)
        try:
            connect()
            error = None
        except ClusterError as e:
            error = e
        cfg, warning = checks.result()
    return cfg, warning, error


def model_summary(cfg) -> dict:
    """Which model the figures are measured with: the checkpoint (its model_type, the backend) or the built-in
    model, and the image / video processing it configured."""
    from ray_mmbatch.models import backend_name
    from ray_mmbatch.run.preflight import checkpoint_family

    im = cfg.image
    out = {"path": cfg.model.path or "", "model_type": checkpoint_family(cfg), "backend": backend_name(cfg.model),
           "tokenizer": cfg.text.tokenizer or "(built-in)", "resize": im.resize}
    out.update({"min_pixels": im.min_pixels, "max_pixels": im.max_pixels} if im.resize == "smart"
               else {"image_size": im.image_size})
    if im.video:
        out["video"] = {"processor": im.video, "sample_frames": im.video_sample_frames, "fps": im.video_fps,
                        "num_frames": im.video_num_frames, "max_pixels": im.video_max_pixels}
    return out


def _throughput(cfg, args) -> int:
    from ray_mmbatch.dataflow.throughput import measure_throughput
    from ray_mmbatch.run.progress import Progress
    from ray_mmbatch.run.sizing import format_sizing

    with Progress("inspect --throughput", total=args.throughput_samples, stream=sys.stderr,
                  log_every_s=args.progress_every) as meter:
        result = measure_throughput(cfg, args.throughput_samples, progress=meter)
    per_accelerator = args.samples_per_accelerator
    if per_accelerator is None and args.tokens_per_accelerator and result["mean_tokens"]:
        per_accelerator = args.tokens_per_accelerator / result["mean_tokens"]
    result["sizing"] = {"accelerators": args.accelerators, "samples_per_accelerator": per_accelerator}
    result["model"] = model = model_summary(cfg)
    print(f"[inspect] throughput on this data, prepared for {model['model_type']} ({model['backend']} backend)\n"
          + format_sizing(result, args.accelerators, per_accelerator), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
