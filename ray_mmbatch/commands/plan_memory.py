"""Estimate the peak memory per GPU of a training run's settings, item by item, before renting the GPU.

Takes the train command's flags: --model (no --model: the built-in model), --lora-rank / --qlora, --freeze,
--fsdp with --num-workers, --gradient-checkpointing, --precision, --max-tokens / --mode / --max-patches.
Parameters are counted exactly on the meta device; the formula of each item is in docs/memory.md.
--measure runs two real optimizer steps at the budget on a synthetic text pack and prints the measured peak
beside the estimate (the GPU's allocator peak with CUDA, else the process's peak RSS growth). Example:

    ray-mmbatch plan --model /ckpt/Qwen2-VL-2B-Instruct --max-tokens 16384 --lora-rank 16 --precision bf16
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from ray_mmbatch.cli import add_config_flags, config_from_args


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(p)
    p.add_argument("--targets", type=int, default=None,
                   help="target tokens per batch for the logits item (default: --max-tokens, every token a target)")
    p.add_argument("--gpu", choices=("auto", "yes", "no"), default="auto",
                   help="estimate for a CUDA worker (precision 'auto' is bf16 there, flash attention if installed): "
                        "auto = --use-gpu or a GPU here (default: auto)")
    p.add_argument("--measure", action="store_true",
                   help="also run two optimizer steps at the budget (synthetic text pack) and print the measured peak")
    p.add_argument("--json", metavar="PATH", default=None, help="also write the estimate (and measure) as JSON here")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    cfg = config_from_args(args)
    import torch

    from ray_mmbatch.train import memory as M
    from ray_mmbatch.train.peak import measure_peak

    cuda_here = torch.cuda.is_available()
    cuda = {"yes": True, "no": False}.get(args.gpu, bool(cfg.train.use_gpu) or cuda_here)
    try:
        if cfg.model.qlora and (int(cfg.model.lora_rank) <= 0 or not cfg.model.path):
            raise ValueError("--qlora trains LoRA adapters on a 4-bit Hugging Face checkpoint: give --model and "
                             "--lora-rank R")
        spec = M.model_spec(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"[plan] error: {e}", file=sys.stderr, flush=True)
        return 2
    settings = M.settings_from(cfg, cuda, args.targets)
    items = M.estimate(spec, settings)
    measured = None
    if args.measure:
        if settings.fsdp and settings.workers > 1:
            print("[plan] --measure runs one process: it cannot measure FSDP's sharding (drop --fsdp to measure one "
                  "unsharded worker)", file=sys.stderr, flush=True)
            return 2
        if cfg.model.qlora and not cuda_here:
            print("[plan] --measure with --qlora needs a CUDA GPU here (4-bit layers run on CUDA only)",
                  file=sys.stderr, flush=True)
            return 2
        measured = measure_peak(cfg)
    workers = f", {settings.workers} workers (FSDP)" if settings.fsdp else ""
    print(f"[plan] {spec.name}: {spec.total_params:,} params ({spec.language_params:,} language, "
          f"{spec.vision_params:,} vision), {spec.trainable_params:,} trainable; {settings.tokens:,} tokens "
          f"({cfg.budget.mode}), {'bf16' if settings.bf16 else 'fp32'}, attention {settings.attention}"
          f"{', gradient checkpointing' if settings.checkpointing else ''}{workers}; per GPU:")
    print(M.format_table(items, measured["peak_bytes"] if measured else None))
    if measured:
        print(f"[plan] measured on {measured['device']}: {measured['method']}")
    if args.json:
        out = {"model": spec.name, "params": {"language": spec.language_params, "vision": spec.vision_params,
                                              "total": spec.total_params, "trainable": spec.trainable_params,
                                              "quantized": spec.quantized_params},
               "settings": dataclasses.asdict(settings),
               "items": [dataclasses.asdict(i) for i in items], "total_bytes": M.total(items),
               "measured": measured}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
