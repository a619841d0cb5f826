"""Prove packing is exact for YOUR checkpoint before spending GPU hours.

Runs packed (or padded) batches of DATA, and the same samples one at a time, through the
model; prints the largest per-token loss difference as JSON and exits 1 above the tolerance
(default 1e-4 nats in fp32, 0.05 in bf16), 2 when no batch could be made.

    ray-mmbatch verify-packing --model /ckpt/Qwen2-VL-2B-Instruct --data DATA --mode pack --batches 8
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
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = build_parser(prog).parse_args(argv)
    cfg = config_from_args(args)

    from ray_mmbatch import local_batches
    from ray_mmbatch.models import configure, get_backend, token_ids
    from ray_mmbatch.run.verify import verify

    cfg = configure(cfg)
    ids = token_ids(cfg)
    model = get_backend(cfg).create_model(cfg, ids).to(args.device)
    report = verify(model, local_batches(cfg, limit=args.batches), ids["pad_id"], args.device,
                    cfg.train.precision if cfg.train.precision != "auto" else "fp32", args.tolerance)
    report["model"] = cfg.model.path or "builtin (random init)"
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
