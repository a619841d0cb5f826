"""Ray Tune budget search on CPU: short real trials, an infeasible one that doesn't stop the
sweep, and the chosen setting is the fastest feasible one, written as a config train takes."""
from __future__ import annotations

import pytest

from ray_mmbatch.config import Config, load_config


@pytest.mark.ray
@pytest.mark.slow
def test_tune_picks_fastest_feasible_and_writes_config(ray_cluster, small_parquet_dataset, tmp_path, monkeypatch):
    from ray_mmbatch.run.tune import format_table, judge, pick_best, tune_budgets
    from tests.test_trackers import (
        mlflow_runs,
        need_trackers,
        read_wandb_log,
        tb_scalars,
        wandb_history,
        wandb_run_files,
        wandb_run_record,
    )

    need_trackers("wandb", "mlflow", "tensorboard")
    # --report-to in a sweep: each trial logs its own run; the MLflow store and the W&B settings are set
    # in this process only (the cluster's workers started before it), so the sweep must hand them to the trials
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("WANDB_API_KEY", "not-to-be-written")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb"))
    monkeypatch.setenv("WANDB_PROJECT", "ray_mmbatch_tests")
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)  # the default group: the sweep folder's name
    (tmp_path / "wandb").mkdir()

    base = Config()
    base.data.path, base.data.format = str(small_parquet_dataset), "parquet"
    base.budget.window = 64
    base.data.eval_split = 0.25  # every trial ends with its held-out loss (--metric eval_loss can rank by it)
    base.train.report_to = "tensorboard,mlflow,wandb"
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
    assert all(0 < t["eval_loss"] < 20 for t in feasible)
    fastest = max(feasible, key=lambda t: t["tokens_per_s"])
    assert res["best"]["setting"] == fastest["setting"]
    table = format_table(trials)
    assert "failed" in table and "tokens/s" in table
    runs = {r.info.run_name: r for r in mlflow_runs(tmp_path)}
    for t in feasible:
        name = "trial-max_tokens=" + str(t["setting"]["budget.max_tokens"])
        losses = [v for _, v in tb_scalars(tmp_path / "tune" / name)["loss"]]
        assert len(losses) == 3 and runs[name].data.metrics["eval_loss"] == pytest.approx(t["eval_loss"])
        assert runs[name].data.params["budget.max_tokens"] == str(t["setting"]["budget.max_tokens"])
    assert "not-to-be-written" not in "".join(p.read_text() for p in (tmp_path / "tune").rglob("params.json"))
    # W&B: one offline run per trial (the failed one too, ended with exit code 1), named after it, grouped by
    # the sweep (WANDB_RUN_GROUP's default: the sweep folder's name), in the sweep's project
    wandb_runs = {}
    for path in wandb_run_files(tmp_path / "wandb"):
        records = read_wandb_log(path)
        wandb_runs[wandb_run_record(records).display_name] = records
    names = {"trial-" + "-".join(f"{k.split('.')[-1]}={v}" for k, v in sorted(t["setting"].items())): t
             for t in trials}
    assert len(wandb_runs) == len(wandb_run_files(tmp_path / "wandb")) == 3 and set(wandb_runs) == set(names)
    assert set(runs) == set(names)  # MLflow: one run per trial as well
    for name, records in wandb_runs.items():
        run = wandb_run_record(records)
        assert run.run_group == "tune" and run.project == "ray_mmbatch_tests", (name, run.run_group, run.project)
        (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
        assert exit_record.exit_code == (0 if names[name]["feasible"] else 1), name
        rows = wandb_history(records)
        assert [r["loss"] for r in rows if "loss" in r] == ([pytest.approx(v) for _, v in tb_scalars(
            tmp_path / "tune" / name)["loss"]] if names[name]["feasible"] else [])
        if names[name]["feasible"]:
            assert [r["eval_loss"] for r in rows if "eval_loss" in r] == [pytest.approx(names[name]["eval_loss"])]

    best = load_config(tmp_path / "tune" / "best.yaml")
    assert best.budget.max_tokens == fastest["setting"]["budget.max_tokens"]
    assert best.data.path == str(small_parquet_dataset)

    # the same trials judged against a memory limit below their peaks: none is feasible, and no best is picked
    # (a sweep of its own cost a whole trial: judge is what the trial calls on its result)
    low = [judge(dict(t, status="ok" if t["feasible"] else t["status"]), memory_limit_mb=1.0) for t in trials]
    assert sorted(t["status"] for t in low) == ["failed", "over_memory", "over_memory"]
    assert pick_best(low) is None and all(t["score"] == -1.0 for t in low)


def test_pick_best_by_metric():
    from ray_mmbatch.run.tune import pick_best

    nan = float("nan")
    trials = [{"setting": {"k": 1}, "feasible": True, "tokens_per_s": 10.0, "eval_loss": 3.0, "final_loss": 2.0},
              {"setting": {"k": 2}, "feasible": True, "tokens_per_s": 20.0, "eval_loss": 4.0, "final_loss": 1.0},
              {"setting": {"k": 3}, "feasible": False, "tokens_per_s": 99.0, "eval_loss": 0.1, "final_loss": 0.1},
              {"setting": {"k": 4}, "feasible": True, "tokens_per_s": 5.0, "eval_loss": nan, "final_loss": 9.0}]
    assert pick_best(trials)["setting"] == {"k": 2}
    assert pick_best(trials, "eval_loss")["setting"] == {"k": 1}
    assert pick_best(trials, "final_loss")["setting"] == {"k": 2}
    assert pick_best(trials[2:3], "eval_loss") is None
