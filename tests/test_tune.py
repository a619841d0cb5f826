"""Ray Tune budget search on CPU: short real trials, an infeasible one that doesn't stop the
sweep, and the chosen setting is the fastest feasible one, written as a config train takes."""
from __future__ import annotations

import pytest

from ray_mmbatch.config import Config, load_config

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_tune_picks_fastest_feasible_and_writes_config(ray_cluster, small_parquet_dataset, tmp_path):
    from ray_mmbatch.run.tune import format_table, tune_budgets

    base = Config()
    base.data.path, base.data.format = str(small_parquet_dataset), "parquet"
    base.budget.window = 64
    settings = [
        {"budget.max_tokens": 512},
        {"budget.max_tokens": 4096},
        # flash-attention cannot run on this CPU machine: the trial fails, is recorded, and the sweep goes on
        {"budget.max_tokens": 8192, "model.attention": "flash"},
    ]
    res = tune_budgets(base, settings, str(tmp_path / "tune"), memory_limit_mb=64_000, warmup_steps=1, steps=2)
    trials = res["trials"]
    assert len(trials) == 3
    by_tokens = {t["setting"]["budget.max_tokens"]: t for t in trials}
    assert by_tokens[8192]["feasible"] is False and by_tokens[8192]["status"] == "failed"
    feasible = [t for t in trials if t["feasible"]]
    assert len(feasible) == 2 and all(t["tokens_per_s"] > 0 and t["peak_mem_mb"] > 0 for t in feasible)
    fastest = max(feasible, key=lambda t: t["tokens_per_s"])
    assert res["best"]["setting"] == fastest["setting"]
    table = format_table(trials)
    assert "failed" in table and "tokens/s" in table

    best = load_config(tmp_path / "tune" / "best.yaml")
    assert best.budget.max_tokens == fastest["setting"]["budget.max_tokens"]
    assert best.data.path == str(small_parquet_dataset)

    # a memory limit below every trial's peak makes every setting infeasible
    low = tune_budgets(base, settings[:1], str(tmp_path / "tune_low"), memory_limit_mb=1.0, warmup_steps=1, steps=1)
    assert low["best"] is None and low["trials"][0]["status"] == "over_memory"
