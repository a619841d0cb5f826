"""Generate a synthetic image-text dataset (optionally with the bad-data corpus).

    ray-mmbatch prepare --out DIR --samples N --format parquet|webdataset|llava --seed S [--bad K]

Timings: benchmarks/RESULTS.md ("prepare_data").
"""
from __future__ import annotations

import argparse
import json
import sys
import time


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    from ray_mmbatch.synthetic.generate import FORMATS, PARQUET_STYLES

    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--samples", type=int, required=True, help="good samples to generate")
    p.add_argument("--format", choices=FORMATS, required=True, help="file format written")
    p.add_argument("--seed", type=int, default=0, help="seed of the generated images and texts")
    p.add_argument("--bad", type=int, default=0, help="bad/hostile samples per kind mixed in")
    p.add_argument("--shard-size", type=int, default=1000, help="samples per shard")
    p.add_argument("--workers", type=int, default=2, help="processes generating shards")
    p.add_argument("--parquet-style", choices=PARQUET_STYLES, default="conversations")
    p.add_argument("--progress-every", type=float, default=5.0, metavar="SECONDS",
                   help="when stderr is not a terminal (a log), one progress line every this many seconds "
                        "(default: 5); on a terminal the line is redrawn in place (a shard at a time)")
    return p


def main(argv: list[str] | None = None, prog: str | None = None) -> dict:
    from ray_mmbatch.run.progress import Progress
    from ray_mmbatch.synthetic.generate import generate_dataset

    a = build_parser(prog).parse_args(argv)
    start = time.perf_counter()
    with Progress("prepare", stream=sys.stderr, log_every_s=a.progress_every) as meter:  # stdout: the summary
        manifest = generate_dataset(a.out, a.samples, a.format, seed=a.seed, shard_size=a.shard_size,
                                    workers=a.workers, bad_per_kind=a.bad, parquet_style=a.parquet_style,
                                    progress=meter)
    summary = {"out": a.out, "format": a.format, "samples": len(manifest["ids"]), "bad": len(manifest["bad"]),
               "valid_unusual": len(manifest["valid_unusual"]), "mixture": manifest["mixture"],
               "shards": len(manifest["paths"]), "seconds": round(time.perf_counter() - start, 2)}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
    sys.exit(0)
