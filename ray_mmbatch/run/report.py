"""Run report: read a training run directory, derive its figures, write HTML + JSON.

Inputs (names from run/rundir.RunDir), all written by the driver of the training run::

    summary.json    final totals (steps, samples, tokens, fill, loss, skipped counts, budget,
                    data_time: where the data time went, run/datatime.py)
    metrics.jsonl   one object per report step (loss, lr, throughput, data wait, memory)
    batches.jsonl   one object per trained batch (step, rank, real/padded/target tokens, budget)
    skipped.csv     sample_id,reason,detail for every skipped sample

Outputs: ``report.json`` (summary table, derived checks and every figure as
Plotly JSON) and ``report.html`` (the same figures, plotly.js inlined once so
the page opens on a machine with no network).

Algorithm: one pass over each file, O(batches + metrics + skipped) time and
memory (per-batch markers all kept; timings in benchmarks/RESULTS.md, "Report").
The derived numbers are recomputed from the per-batch rows rather than copied
from summary.json, so a wrong total in the summary shows up as a warning instead
of being repeated.

Tolerance: a run killed mid-write leaves a final JSONL line without its
newline; that one line is ignored and counted in ``warnings``. Any other
malformed line is an error naming file and line. Pure module: no ray.
"""
from __future__ import annotations

import csv
import html
import json
import math
from pathlib import Path
from typing import Any

from ray_mmbatch import schema
from ray_mmbatch.run import datatime
from ray_mmbatch.run.rundir import RunDir, read_jsonl

_BATCH_REQUIRED = ("step", schema.BATCH_REAL_TOKENS, schema.BATCH_PADDED_TOKENS)
KNOWN_SKIP_REASONS = frozenset(v for k, v in vars(schema).items() if k.startswith("SKIP_"))
# (div id, title) in page order; the HTML div ids and the report.json "figures" keys.
FIGURES = (
    ("fig-fill", "Fill per batch (real / padded tokens)"),
    ("fig-tokens", "Tokens per batch against the budget"),
    ("fig-samples", "Samples per batch"),
    ("fig-loss", "Loss over steps"),
    ("fig-throughput", "Throughput over steps"),
    ("fig-data-wait", "Share of step time waiting for data"),
    ("fig-skips", "Skipped samples by reason"),
)


def _read_skipped(path: Path, warnings: list[str]) -> list[dict[str, str]]:
    if not path.exists():
        warnings.append(f"{path.name} missing")
        return []
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"sample_id", "reason"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: header must be sample_id,reason,detail; got {reader.fieldnames}")
        return list(reader)


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """Read the run files into plain Python objects; summary.json is required."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run dir {run_dir} does not exist")
    summary_path = run_dir / RunDir.SUMMARY
    if not summary_path.exists():
        raise FileNotFoundError(f"{summary_path} missing: is {run_dir} a training run's output dir?")
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{summary_path}: invalid JSON ({e.msg})") from None
    warnings: list[str] = []
    return {
        "run_dir": str(run_dir),
        "summary": summary,
        "metrics": read_jsonl(run_dir / RunDir.METRICS, ("step",), warnings),
        "batches": read_jsonl(run_dir / RunDir.BATCHES, _BATCH_REQUIRED, warnings),
        "skipped": _read_skipped(run_dir / RunDir.SKIPPED, warnings),
        "warnings": warnings,
    }


def _reason(raw: str) -> str:
    # Reasons may carry a detail ("corrupt_image: truncated"); count by the reason alone.
    return schema.parse_skip(raw)[0]


def _col(rows: list[dict[str, Any]], key: str) -> list[Any]:
    return [r.get(key) for r in rows]


def batch_stats(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Fill, token totals and budget violations recomputed from the per-batch rows."""
    if not batches:
        return {"n_batches": 0}
    real = [int(b["real_tokens"]) for b in batches]
    padded = [int(b["padded_tokens"]) for b in batches]
    fills = [r / p if p else 0.0 for r, p in zip(real, padded)]
    over = [b for b in batches if b.get("budget_tokens") and int(b["padded_tokens"]) > int(b["budget_tokens"])]
    return {
        "n_batches": len(batches),
        "ranks": sorted({int(b.get("rank", 0)) for b in batches}),
        "real_tokens": sum(real),
        "padded_tokens": sum(padded),
        "target_tokens": sum(int(b.get("target_tokens", 0)) for b in batches),
        "samples": sum(int(b.get("n_samples", 0)) for b in batches),
        "fill_overall": sum(real) / sum(padded) if sum(padded) else 0.0,
        "fill_mean": sum(fills) / len(fills),
        "fill_min": min(fills),
        "batches_over_budget": len(over),
    }


def skip_counts(summary: dict[str, Any], skipped_rows: list[dict[str, str]]) -> dict[str, Any]:
    from_summary: dict[str, int] = {}
    for reason, n in (summary.get("skipped") or {}).items():
        from_summary[_reason(reason)] = from_summary.get(_reason(reason), 0) + int(n)
    from_csv: dict[str, int] = {}
    for row in skipped_rows:
        from_csv[_reason(row["reason"])] = from_csv.get(_reason(row["reason"]), 0) + 1
    return {"summary": dict(sorted(from_summary.items())), "csv": dict(sorted(from_csv.items())),
            "total": sum(from_summary.values()) if from_summary else sum(from_csv.values())}


def _checks(summary: dict[str, Any], stats: dict[str, Any], skips: dict[str, Any], warnings: list[str]) -> None:
    if stats.get("batches_over_budget"):
        warnings.append(f"{stats['batches_over_budget']} batches exceed their token budget")
    if skips["summary"] and skips["csv"] and skips["summary"] != skips["csv"]:
        warnings.append(f"skip counts differ: summary.json {skips['summary']} vs skipped.csv {skips['csv']}")
    unknown = sorted((set(skips["summary"]) | set(skips["csv"])) - KNOWN_SKIP_REASONS)
    if unknown:
        warnings.append(f"unknown skip reasons (not in schema.SKIP_*): {unknown}")
    for key in ("real_tokens", "padded_tokens"):
        if key in summary and stats.get("n_batches") and int(summary[key]) != stats[key]:
            warnings.append(f"summary.json {key}={summary[key]} but batches.jsonl sums to {stats[key]}")


def summary_figures(summary: dict[str, Any], stats: dict[str, Any], skips: dict[str, Any],
                  metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The small table at the top of the page, label -> value, in display order."""
    budget = summary.get("budget") or {}
    peaks = [m["peak_mem_mb"] for m in metrics if m.get("peak_mem_mb") is not None]
    return dict([
        ("mode", budget.get("mode")), ("max_tokens", budget.get("max_tokens")),
        ("steps", summary.get("steps")), ("samples", summary.get("samples")),
        ("batches", stats.get("n_batches")), ("ranks", len(stats.get("ranks", [])) or None),
        ("real_tokens", summary.get("real_tokens")), ("padded_tokens", summary.get("padded_tokens")),
        ("fill", summary.get("fill")), ("mean fill per batch", stats.get("fill_mean")),
        ("batches over budget", stats.get("batches_over_budget")),
        ("tokens_per_s", summary.get("tokens_per_s")),
        ("loss initial -> final", f"{_fmt(summary.get('initial_loss'))} -> {_fmt(summary.get('final_loss'))}"),
        *([("eval_loss", summary["eval_loss"])] if summary.get("eval_loss") is not None else []),
        ("skipped samples", skips["total"]), ("peak_mem_mb", max(peaks) if peaks else None),
        ("wall_s", summary.get("wall_s")),
        *datatime.table(summary.get("data_time") or {}),  # per stage, the wait, the verdict
    ])


def _plotly():
    try:
        import plotly.graph_objects as go
        import plotly.offline
    except ImportError as e:
        raise ImportError("the run report needs plotly: pip install 'ray_mmbatch[report]'") from e
    return go, plotly.offline


_PALETTE = ("#636efa", "#ef553b", "#00cc96", "#ab63fa", "#ffa15a", "#19d3f3", "#ff6692", "#b6e880")


def build_figures(run: dict[str, Any]) -> dict[str, Any]:
    """One Plotly figure per FIGURES entry; per-batch plots get one trace per rank."""
    go, _ = _plotly()
    batches, metrics = run["batches"], run["metrics"]
    figs = {fid: go.Figure(layout={"title": {"text": title}, "template": "plotly_white", "height": 360,
                                   "margin": {"l": 60, "r": 60, "t": 80, "b": 45},
                                   "legend": {"orientation": "h", "x": 0, "y": 1.02, "yanchor": "bottom"}})
            for fid, title in FIGURES}
    for rank in sorted({int(b.get("rank", 0)) for b in batches}):
        rows = [b for b in batches if int(b.get("rank", 0)) == rank]
        steps = _col(rows, "step")
        colour = {"color": _PALETTE[rank % len(_PALETTE)]}
        fill = [b["real_tokens"] / b["padded_tokens"] if b["padded_tokens"] else 0.0 for b in rows]
        figs["fig-fill"].add_scatter(x=steps, y=fill, mode="markers", name=f"rank {rank}", marker=colour)
        figs["fig-tokens"].add_scatter(x=steps, y=_col(rows, "padded_tokens"), mode="markers",
                                       name=f"padded, rank {rank}", marker=colour)
        figs["fig-tokens"].add_scatter(x=steps, y=_col(rows, "real_tokens"), mode="markers",
                                       name=f"real, rank {rank}", marker=colour | {"symbol": "x"})
        figs["fig-samples"].add_scatter(x=steps, y=_col(rows, "n_samples"), mode="markers", name=f"rank {rank}",
                                        marker=colour)
    if batches:
        order = sorted(batches, key=lambda b: b.get("step", 0))
        figs["fig-tokens"].add_scatter(x=_col(order, "step"), y=_col(order, "budget_tokens"), mode="lines",
                                       name="budget", line={"color": "black", "dash": "dash"})
    steps = _col(metrics, "step")
    figs["fig-loss"].add_scatter(x=steps, y=_col(metrics, "loss"), mode="lines+markers", name="loss")
    evals = [m for m in metrics if m.get("eval_loss") is not None]  # --eval-split / --eval-data
    if evals:
        figs["fig-loss"].add_scatter(x=_col(evals, "step"), y=_col(evals, "eval_loss"), mode="lines+markers",
                                     name="eval_loss (held out)")
    for key in ("tokens_per_s", "padded_tokens_per_s"):
        figs["fig-throughput"].add_scatter(x=steps, y=_col(metrics, key), mode="lines+markers", name=key)
    figs["fig-throughput"].add_scatter(x=steps, y=_col(metrics, "samples_per_s"), mode="lines+markers",
                                       name="samples_per_s", yaxis="y2")
    figs["fig-throughput"].update_layout(yaxis2={"overlaying": "y", "side": "right", "title": "samples/s"},
                                         yaxis={"title": "tokens/s"})
    figs["fig-data-wait"].add_scatter(x=steps, y=_col(metrics, "data_wait_frac"), mode="lines+markers",
                                      name="data_wait_frac")
    figs["fig-data-wait"].update_layout(yaxis={"range": [0, 1], "title": "fraction"})
    skips = run["skip_counts"]
    figs["fig-skips"].add_bar(x=list(skips["summary"]), y=list(skips["summary"].values()), name="summary.json")
    if skips["csv"] != skips["summary"]:
        figs["fig-skips"].add_bar(x=list(skips["csv"]), y=list(skips["csv"].values()), name="skipped.csv")
    for fid in ("fig-fill", "fig-tokens", "fig-samples", "fig-loss", "fig-throughput", "fig-data-wait"):
        figs[fid].update_xaxes(title="step")
    return figs


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return "" if v is None else str(v)


def render_html(report: dict[str, Any], figs: dict[str, Any]) -> str:
    _, offline = _plotly()
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(_fmt(v))}</td></tr>"
                   for k, v in report["table"].items())
    warn = "".join(f"<li>{html.escape(w)}</li>" for w in report["warnings"]) or "<li>none</li>"
    divs = "".join("<div>" + figs[fid].to_html(full_html=False, include_plotlyjs=False, div_id=fid,
                                     config={"displaylogo": False, "responsive": True}) + "</div>"
                   for fid, _ in FIGURES)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>ray_mmbatch run report</title>"
        "<style>body{font-family:sans-serif;margin:20px}table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:3px 10px;text-align:left}th{background:#f3f3f3}"
        # Two figures per row keeps the whole report in one 1400x2400 screenshot.
        # Fixed tracks: plotly sizes each plot as its script runs, before later cells exist.
        ".figs{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:8px}"
        "@media (max-width:1100px){.figs{grid-template-columns:minmax(0,1fr)}}"
        ".top{display:flex;gap:40px;align-items:flex-start}</style>"
        f"<script type='text/javascript'>{offline.get_plotlyjs()}</script></head><body>"
        f"<h1>Run report: {html.escape(Path(report['run_dir']).name)}</h1>"
        f"<p><code>{html.escape(report['run_dir'])}</code></p>"
        + (f"<p><b>{html.escape(report['data_verdict'])}</b></p>" if report.get("data_verdict") else "") +
        f"<div class='top'><table>{rows}</table><div><h3>Warnings</h3><ul>{warn}</ul></div></div>"
        f"<div class='figs'>{divs}</div></body></html>"
    )


def _figure_json(fig: Any) -> dict[str, Any]:
    d = json.loads(fig.to_json())
    # The template is ~10 KB of styling per figure and the same for all; keep the JSON to the data.
    d["layout"].pop("template", None)
    return d


def make_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Write report.json and report.html for ``run_dir`` (into ``out_dir``, default run_dir); return the JSON."""
    run = load_run(run_dir)
    stats = batch_stats(run["batches"])
    run["skip_counts"] = skip_counts(run["summary"], run["skipped"])
    warnings = run["warnings"]
    _checks(run["summary"], stats, run["skip_counts"], warnings)
    figs = build_figures(run)
    report = {
        "run_dir": run["run_dir"],
        "table": summary_figures(run["summary"], stats, run["skip_counts"], run["metrics"]),
        "batch_stats": stats,
        "skipped": run["skip_counts"],
        "n_metrics": len(run["metrics"]),
        "data_verdict": (run["summary"].get("data_time") or {}).get("verdict", ""),
        "warnings": warnings,
        "figures": {fid: _figure_json(fig) for fid, fig in figs.items()},
    }
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / RunDir.REPORT_JSON).write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    (out / RunDir.REPORT_HTML).write_text(render_html(report, figs), encoding="utf-8")
    return report
