"""The run report: figures recomputed from a generated run dir, self-contained HTML, clear errors.

The run dir is written the way the training run writes it (run/rundir.RunDir), with
numpy-made values shaped like a real 2-rank pack-mode run, so the expected
numbers are computed here independently of ray_mmbatch.run.report.
"""
from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ray_mmbatch import schema
from ray_mmbatch.run.report import FIGURES, make_report
from ray_mmbatch.run.rundir import RunDir

REPO = Path(__file__).resolve().parents[1]
SKIPS = [("s-0003", schema.SKIP_CORRUPT_IMAGE, "truncated JPEG"), ("s-0017", schema.SKIP_MISSING_FILE, "a/b.png"),
         ("s-0018", schema.SKIP_MISSING_FILE, "a/c.png"), ("s-0101", schema.SKIP_OVERSIZE, "9000 tokens"),
         ("s-0240", schema.SKIP_PLACEHOLDER_MISMATCH, "2 placeholders, 1 image"),
         ("s-0333", schema.SKIP_MISSING_FILE, "x.jpg"), ("s-0412", schema.SKIP_NOT_AN_IMAGE, "")]


def write_fake_run(run_dir: Path, steps: int = 60, ranks: int = 2, budget: int = 4096, seed: int = 0) -> dict:
    """A pack-mode run: every batch occupies the budget, fill ~0.93, loss decaying from ~9."""
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    batches = []
    for step in range(1, steps + 1):
        for rank in range(ranks):
            real = int(budget * rng.beta(30, 2))
            n_samples = max(1, int(real / rng.normal(310, 30)))
            batches.append({"step": step, "rank": rank, "real_tokens": real, "padded_tokens": budget,
                            "target_tokens": int(real * 0.3), "n_samples": n_samples,
                            "n_images": n_samples + int(rng.integers(0, 3)), "patches": 4 * real,
                            "budget_tokens": budget})
    metrics = []
    every = 5 if steps >= 10 else 1
    for step in range(every, steps + 1, every):
        step_time = float(rng.normal(0.8, 0.05))
        tps = ranks * budget * 0.93 / step_time
        metrics.append({"step": step, "loss": float(9.0 * np.exp(-step / 25) + 1.5 + rng.normal(0, 0.05)),
                        "lr": 3e-3 * min(1.0, step / 10), "tokens_per_s": tps, "padded_tokens_per_s": tps / 0.93,
                        "samples_per_s": tps / 310, "fill": float(rng.beta(30, 2)), "step_time_s": step_time,
                        "data_wait_frac": float(rng.uniform(0.0, 0.2)), "peak_mem_mb": 900.0 + step})
    (run_dir / RunDir.BATCHES).write_text("".join(json.dumps(b) + "\n" for b in batches))
    (run_dir / RunDir.METRICS).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    with (run_dir / RunDir.SKIPPED).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sample_id", "reason", "detail"])
        w.writerows(SKIPS)
    real = sum(b["real_tokens"] for b in batches)
    padded = sum(b["padded_tokens"] for b in batches)
    skipped: dict[str, int] = {}
    for _, reason, _ in SKIPS:
        skipped[reason] = skipped.get(reason, 0) + 1
    summary = {"steps": steps, "samples": sum(b["n_samples"] for b in batches), "real_tokens": real,
               "padded_tokens": padded, "fill": real / padded, "tokens_per_s": metrics[-1]["tokens_per_s"],
               "initial_loss": metrics[0]["loss"], "final_loss": metrics[-1]["loss"], "skipped": skipped,
               "wall_s": 51.3, "config": {"train": {"num_workers": ranks}},
               "budget": {"max_tokens": budget, "mode": "pack"}}
    (run_dir / RunDir.SUMMARY).write_text(json.dumps(summary))
    return {"batches": batches, "metrics": metrics, "summary": summary}


def test_report_values_match_inputs(tmp_path):
    made = write_fake_run(tmp_path)
    report = make_report(tmp_path)
    on_disk = json.loads((tmp_path / RunDir.REPORT_JSON).read_text())
    assert on_disk["batch_stats"] == report["batch_stats"]

    b = made["batches"]
    fills = np.array([x["real_tokens"] / x["padded_tokens"] for x in b])
    stats = on_disk["batch_stats"]
    assert stats["n_batches"] == 120 and stats["ranks"] == [0, 1]
    assert stats["fill_mean"] == pytest.approx(fills.mean())
    assert stats["fill_min"] == pytest.approx(fills.min())
    assert stats["fill_overall"] == pytest.approx(made["summary"]["fill"])
    assert stats["real_tokens"] == made["summary"]["real_tokens"]
    assert stats["batches_over_budget"] == 0
    assert on_disk["skipped"]["csv"] == {"corrupt_image": 1, "missing_file": 3, "not_an_image": 1,
                                         "oversize": 1, "placeholder_mismatch": 1}
    assert on_disk["skipped"]["summary"] == on_disk["skipped"]["csv"] and on_disk["skipped"]["total"] == 7
    assert on_disk["warnings"] == []
    assert on_disk["table"]["batches"] == 120 and on_disk["table"]["peak_mem_mb"] == 960.0

    figs = on_disk["figures"]
    assert set(figs) == {fid for fid, _ in FIGURES}
    fill_y = [y for trace in figs["fig-fill"]["data"] for y in trace["y"]]
    assert sorted(fill_y) == pytest.approx(sorted(fills))
    budget_trace = [t for t in figs["fig-tokens"]["data"] if t["name"] == "budget"][0]
    assert set(budget_trace["y"]) == {4096}
    assert figs["fig-loss"]["data"][0]["y"] == pytest.approx([m["loss"] for m in made["metrics"]])
    assert len(figs["fig-loss"]["data"]) == 1 and "eval_loss" not in on_disk["table"]  # no held-out set
    skip_bar = figs["fig-skips"]["data"][0]
    assert dict(zip(skip_bar["x"], skip_bar["y"])) == on_disk["skipped"]["csv"]


def test_html_is_self_contained_and_has_every_plot(tmp_path):
    write_fake_run(tmp_path, steps=10)
    make_report(tmp_path)
    page = (tmp_path / RunDir.REPORT_HTML).read_text()
    for fid, title in FIGURES:
        assert f'id="{fid}"' in page, fid
        assert title in page.replace("\\u002f", "/")  # plotly's JSON escapes "/"
    assert not re.search(r"<script[^>]*\bsrc\s*=", page, re.I), "external script tag"
    assert not re.search(r"<link[^>]*\bhref\s*=\s*['\"]?https?:", page, re.I)
    assert "Plotly.newPlot" in page and len(page) > 1_000_000  # plotly.js inlined (~4.6 MB)


def test_problems_in_the_run_become_warnings(tmp_path):
    made = write_fake_run(tmp_path, steps=10)
    over = dict(made["batches"][3], padded_tokens=5000, real_tokens=4500)
    lines = (tmp_path / RunDir.BATCHES).read_text().splitlines()
    lines[3] = json.dumps(over)
    # A run killed mid-write: last line cut short, no newline.
    (tmp_path / RunDir.BATCHES).write_text("\n".join(lines) + "\n" + '{"step": 11, "ra')
    with (tmp_path / RunDir.SKIPPED).open("a", newline="") as f:
        csv.writer(f).writerow(["s-9999", "gremlins", "?"])
    report = make_report(tmp_path)
    assert report["batch_stats"]["batches_over_budget"] == 1
    assert report["batch_stats"]["n_batches"] == 20
    text = "\n".join(report["warnings"])
    assert "1 batches exceed their token budget" in text
    assert "truncated last line" in text
    assert "skip counts differ" in text and "gremlins" in text
    assert "batches.jsonl sums to" in text  # summary real/padded no longer match the rows
    names = [t["name"] for t in report["figures"]["fig-skips"]["data"]]
    assert names == ["summary.json", "skipped.csv"]


def test_bad_run_dirs_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        make_report(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="summary.json missing"):
        make_report(tmp_path)
    write_fake_run(tmp_path, steps=3)
    (tmp_path / RunDir.METRICS).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        make_report(tmp_path)
    (tmp_path / RunDir.METRICS).write_text('{"step": 1}\n')
    (tmp_path / RunDir.BATCHES).write_text('{"step": 1, "real_tokens": 10}\n')
    with pytest.raises(ValueError, match=r"batches.jsonl:1: missing or non-numeric \['padded_tokens'\]"):
        make_report(tmp_path)
    (tmp_path / RunDir.BATCHES).write_text('{"step": 1, "real_tokens": 10, "padded_tokens": 16}\n')
    (tmp_path / RunDir.SKIPPED).write_text("id,why\nx,y\n")
    with pytest.raises(ValueError, match="header must be"):
        make_report(tmp_path)


def test_missing_optional_files_still_report(tmp_path):
    write_fake_run(tmp_path, steps=3)
    for name in (RunDir.METRICS, RunDir.BATCHES, RunDir.SKIPPED):
        (tmp_path / name).unlink()
    report = make_report(tmp_path)
    assert report["batch_stats"] == {"n_batches": 0}
    assert report["skipped"]["summary"]["missing_file"] == 3  # from summary.json alone
    assert sum("missing" in w for w in report["warnings"]) == 3
    assert (tmp_path / RunDir.REPORT_HTML).exists()


def test_missing_plotly_is_a_clear_error(tmp_path):
    write_fake_run(tmp_path, steps=3)
    # A fresh interpreter where importing plotly fails, as on an install without the extra.
    code = ("import sys; sys.modules['plotly'] = None\n"
            "from ray_mmbatch.run.report import make_report\n"
            f"make_report({str(tmp_path)!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "pip install 'ray_mmbatch[report]'" in proc.stderr


def test_cli_writes_both_files(tmp_path):
    write_fake_run(tmp_path, steps=5)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(REPO / "jobs" / "report.py"), str(tmp_path), "--out", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert (out / RunDir.REPORT_HTML).exists() and (out / RunDir.REPORT_JSON).exists()
    bad = subprocess.run([sys.executable, str(REPO / "jobs" / "report.py"), str(tmp_path / "missing")],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 1 and "does not exist" in bad.stderr


def test_eval_loss_is_plotted_beside_the_loss(tmp_path):
    made = write_fake_run(tmp_path)
    metrics = made["metrics"]
    for k in (3, 7, len(metrics) - 1):  # reports that came with an evaluation (--eval-every)
        metrics[k]["eval_loss"] = metrics[k]["loss"] + 0.25
    (tmp_path / RunDir.METRICS).write_text("".join(json.dumps(m) + "\n" for m in metrics))
    summary = {**made["summary"], "eval_loss": metrics[-1]["eval_loss"]}
    (tmp_path / RunDir.SUMMARY).write_text(json.dumps(summary))
    report = json.loads(json.dumps(make_report(tmp_path), default=str))
    on_disk = json.loads((tmp_path / RunDir.REPORT_JSON).read_text())
    trace = [t for t in on_disk["figures"]["fig-loss"]["data"] if t["name"].startswith("eval_loss")]
    assert len(trace) == 1
    assert trace[0]["x"] == [metrics[k]["step"] for k in (3, 7, len(metrics) - 1)]
    assert trace[0]["y"] == pytest.approx([metrics[k]["eval_loss"] for k in (3, 7, len(metrics) - 1)])
    assert on_disk["table"]["eval_loss"] == pytest.approx(summary["eval_loss"]) and report


def _data_time_totals(wait_s: float, first_wait_s: float) -> dict:
    """Two ranks' DataClock sums as the loop all-reduces them (numbers made for easy arithmetic)."""
    from ray_mmbatch.run import datatime

    totals = None
    for _rank in range(2):
        clock = datatime.DataClock()
        for b in range(10):  # 10 batches a rank, each 1+2+0.5+6.5 = 10 s of data work
            clock.row([1.0, 2.0, 0.5, 6.5, 100.0], asked_at=90.0 if b % 2 else 100.1,  # ready before asked or not
                      decoded_at=100.25 if b else None)  # 9 decoded: 0.25 s or 0.15 s each
        clock.row([0.5, 0.5, 0.0, 0.0, 99.0])  # a row carrying only skip records: never decoded
        for s in range(10):
            clock.step(wait_s / 20, 1.0, first=s == 0)
        vals = clock.take()
        assert clock.take() == [0.0] * len(datatime.CLOCKS)  # take starts the sums again
        vals[datatime.CLOCKS.index("first_wait_s")] = first_wait_s / 2  # each rank's first step waited longer
        totals = datatime.add(totals, vals)
    return totals


def test_data_time_sums_per_stage_and_says_whether_to_add_cpus():
    from ray_mmbatch.run import datatime
    from ray_mmbatch.run.sizing import HEADROOM

    fed = datatime.summarize(_data_time_totals(wait_s=0.4, first_wait_s=0.2), samples=400, train_s=20.0,
                             data_cpus=6.25, ranks=2)
    assert fed["read_s"] == 21.0 and fed["measure_s"] == 41.0 and fed["plan_s"] == 10.0
    assert fed["materialize_s"] == 130.0 and fed["data_s"] == 202.0 and fed["batches"] == 22
    assert fed["transfer_s"] == pytest.approx(2 * (5 * 0.25 + 4 * 0.15))
    assert fed["step_s"] == 20.0 and fed["wait_s"] == pytest.approx(0.4) and fed["wait_share"] == 0.02
    assert fed["first_batch_s"] == pytest.approx(0.1)  # 0.2 s over 2 first steps
    assert fed["steady_wait_share"] == pytest.approx(0.2 / 18, abs=1e-4)
    assert fed["samples_per_data_cpu_s"] == pytest.approx(400 / 202, abs=0.01)
    assert fed["busy_data_cpus"] == pytest.approx(202 / 20, abs=0.01)
    assert fed["verdict"].startswith("data wait 1% of step time after the first batch (0.1 s)")
    assert fed["verdict"].endswith("the accelerators are fed")
    json.dumps(fed)  # summary.json holds it as is

    starved = datatime.summarize(_data_time_totals(wait_s=8.0, first_wait_s=1.0), samples=400, train_s=20.0,
                                 data_cpus=6.25, ranks=2)
    assert starved["wait_share"] == 0.4 and starved["steady_wait_share"] == pytest.approx(7 / 18, abs=1e-4)
    per_worker = 400 / (20 - 8)
    need = HEADROOM * 2 * per_worker / (400 / 202)
    assert starved["samples_per_worker_s"] == pytest.approx(per_worker, abs=0.01)
    text = starved["verdict"]
    assert text.startswith("data wait 39% of step time after the first batch (0.5 s): the data side is the bottleneck")
    assert f"~{int(np.ceil(need - 6.25))} more data CPUs ({need:.1f} in all" in text

    enough = datatime.summarize(_data_time_totals(wait_s=8.0, first_wait_s=1.0), samples=400, train_s=20.0,
                                data_cpus=64, ranks=2)
    assert "yet its 64 data CPUs should supply it" in enough["verdict"]
    assert datatime.summarize(None, 0, 0.0, 4, 1) == {}  # a run that took no batch


def test_report_tables_the_data_time(tmp_path):
    from ray_mmbatch.run import datatime

    made = write_fake_run(tmp_path, steps=5)
    dt = datatime.summarize(_data_time_totals(wait_s=8.0, first_wait_s=1.0), samples=400, train_s=20.0,
                            data_cpus=6.25, ranks=2)
    (tmp_path / RunDir.SUMMARY).write_text(json.dumps({**made["summary"], "data_time": dt}))
    report = make_report(tmp_path)
    table = report["table"]
    assert table["data: read"] == "21.00 s (10%)" and table["data: materialize"] == "130.00 s (64%)"
    assert table["data: all stages"] == "202.00 s over 22 batches"
    assert table["data: step waited"] == "8.00 s of 20.00 s (40%; 39% after the first batch)"
    assert table["samples/s per data CPU"] == "2.0" and table["data verdict"] == dt["verdict"]
    assert report["data_verdict"] == dt["verdict"]
    page = (tmp_path / RunDir.REPORT_HTML).read_text()
    assert "the data side is the bottleneck" in page and "data: measure" in page
    # a run from before data_time: no rows, no line
    write_fake_run(tmp_path / "old", steps=3)
    old = make_report(tmp_path / "old")
    assert not any(k.startswith("data") for k in old["table"]) and old["data_verdict"] == ""
