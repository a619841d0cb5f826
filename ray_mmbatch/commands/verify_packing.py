"""Prove packing is exact for YOUR checkpoint before spending GPU hours.

Runs packed (or padded) batches of DATA, and the same samples one at a time, through the
model; prints the largest per-token loss difference as JSON and exits 1 above the tolerance
(default 1e-4 nats in fp32, 0.05 in bf16), 2 when no batch could be made.

On the model you fine-tune: the training flags --lora-rank / --lora-alpha / --lora-targets (and
--freeze) put fresh adapters on it as a run does, or --adapter OUTPUT_DIR/adapter puts a finished
run's adapter on --model. With adapters on, the gradients of the trainable (LoRA) weights are
compared too (--grads auto; on / off to choose).

    ray-mmbatch verify-packing --model /ckpt/Qwen2-VL-2B-Instruct --data DATA --mode pack --batches 8
    ray-mmbatch verify-packing --model /ckpt/Qwen2-VL-2B-Instruct --adapter runs/lora/adapter --data DATA
"""
from __future__ import annotations

import argparse
import json
import sys

from ray_mmbatch.cli import add_config_flags, config_from_args


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_flags(parser)
    parser.add_argument("--batches", type=int, default=4, help="batches to check (default: 4)")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest allowed per-token difference in nats (default: 1e-4 fp32, 0.05 bf16)")
    parser.add_argument("--device", default="cuda" if _cuda() else "cpu", help="torch device (default: cuda if any)")
    parser.add_argument("--adapter", default="", metavar="DIR",
                        help="a PEFT LoRA adapter directory (a run's OUTPUT_DIR/adapter) to put on --model first")
    parser.add_argument("--grads", choices=("auto", "on", "off"), default="auto",
                        help="also compare the gradients of the weights that train (requires_grad); auto: when "
                             "LoRA adapters are on (default: auto)")
    parser.add_argument("--grad-tolerance", type=float, default=None,
                        help="largest allowed ||g_planned - g_alone|| / ||g_alone|| per batch "
                             "(default: 1e-4 fp32, 0.05 bf16)")
    parser.add_argument("--progress-every", type=float, default=5.0, metavar="SECONDS",
                        help="when stderr is not a terminal (a log), one progress line every this many seconds "
                             "(default: 5); on a terminal the line is redrawn in place")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    cfg = config_from_args(args)

    import torch

    from ray_mmbatch import local_batches
    from ray_mmbatch.models import configure, get_backend, token_ids
    from ray_mmbatch.models import trainable as T
    from ray_mmbatch.run.progress import Progress, counted
    from ray_mmbatch.run.verify import verify

    try:  # a setting the checkpoint contradicts, or flags that do not go together: one line, exit 2 (as train)
        if args.adapter and int(cfg.model.lora_rank):
            raise ValueError("--adapter brings its own LoRA layers: leave out --lora-rank")
        T.check_config(cfg)
        cfg = configure(cfg)
    except ValueError as e:
        print(f"[verify-packing] error: {e}", file=sys.stderr, flush=True)
        return 2
    ids = token_ids(cfg)
    torch.manual_seed(cfg.train.seed)  # the built-in model's weights and fresh adapters as a run draws them
    model = get_backend(cfg).create_model(cfg, ids)
    if args.adapter:
        T.load_adapter(model, args.adapter)
        if cfg.model.freeze:
            T.freeze(model, cfg.model.freeze)
    else:
        T.configure_trainable(model, cfg)
    model = model.to(args.device)
    lora = hasattr(model, "lora_config")
    with Progress("verify-packing", total=args.batches, unit="batches", stream=sys.stderr,
                  log_every_s=args.progress_every) as meter:  # stdout: the JSON report
        report = verify(model, counted(local_batches(cfg, limit=args.batches), meter), ids["pad_id"], args.device,
                        cfg.train.precision if cfg.train.precision != "auto" else "fp32", args.tolerance,
                        grads=args.grads == "on" or (args.grads == "auto" and lora),
                        grad_tolerance=args.grad_tolerance)
    report["model"] = cfg.model.path or "builtin (random init)"
    if lora:
        c = model.lora_config
        targets = c.target_modules if isinstance(c.target_modules, str) else len(c.target_modules or ())
        report["lora"] = {"adapter": args.adapter or None, "r": c.r, "alpha": c.lora_alpha, "targets": targets}
    print(json.dumps(report, indent=2))
    if not report["batches"]:
        return 2
    return 0 if report["ok"] else 1


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
