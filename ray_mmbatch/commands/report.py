"""Write RUN_DIR/report.html and RUN_DIR/report.json from a training run's output dir.

    ray-mmbatch report runs/demo            # -> runs/demo/report.html, runs/demo/report.json
    ray-mmbatch report runs/demo --out /tmp/r

Needs plotly (``pip install 'ray_mmbatch[report]'``). Exits 1 with the reason on a
missing or malformed run dir; prints warnings (budget exceeded, skip counts that
disagree, truncated files) but still writes the report, since a report of a broken
run is what you want most.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ray_mmbatch.run.rundir import RunDir


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="training output dir holding summary.json, metrics.jsonl, ...")
    parser.add_argument("--out", default=None, help="write the report here instead of RUN_DIR")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from ray_mmbatch.run.report import make_report

    args = build_parser(prog).parse_args(argv)
    try:
        report = make_report(args.run_dir, args.out)
    except (FileNotFoundError, ValueError, ImportError) as e:
        print(f"report: {e}", file=sys.stderr)
        return 1
    out = Path(args.out or args.run_dir)
    for w in report["warnings"]:
        print(f"warning: {w}", file=sys.stderr)
    stats = report["batch_stats"]
    print(f"{stats.get('n_batches', 0)} batches, fill {stats.get('fill_overall', 0):.3f}, "
          f"{report['skipped']['total']} skipped")
    print(out / RunDir.REPORT_HTML)
    print(out / RunDir.REPORT_JSON)
    return 0


if __name__ == "__main__":
    sys.exit(main())
