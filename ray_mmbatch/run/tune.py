"""Ray Tune search over batch budgets: the fastest real tokens/s under a memory limit.

Each trial is a short training run (warm-up steps, then measured steps) of the
real model on the real data path. Train V2 pattern: the Tune function builds a
``TorchTrainer`` and runs it, with ``TuneReportCallback`` forwarding the
workers' reports (``Tuner(trainer)`` is deprecated in this Ray and fails).

A trial that runs out of memory, fails, or passes the memory limit is recorded
as infeasible with its figures; it never takes the sweep down. Memory is the
peak GPU memory on GPU and the peak resident memory of a train worker process
on CPU (what an OOM killer would look at).
"""
from __future__ import annotations

import copy
import json
import os
import traceback
from pathlib import Path
from typing import Any

from ray import tune

from ray_mmbatch.config import Config, apply_overrides, save_config
from ray_mmbatch.run.rundir import RunDir, read_jsonl


def grid(space: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """The product of per-field value lists -> a list of settings ({"section.field": value})."""
    settings: list[dict[str, Any]] = [{}]
    for key, values in space.items():
        settings = [{**s, key: v} for s in settings for v in values]
    return settings


def _trial_metrics(out_dir: Path, warmup_steps: int) -> dict[str, float]:
    """Throughput over the steps after warm-up, from the cumulative totals in metrics.jsonl."""
    rows = read_jsonl(out_dir / RunDir.METRICS)
    if not rows:
        return {}
    start = max((r for r in rows if r["step"] <= warmup_steps), key=lambda r: r["step"], default=None)
    end = rows[-1]
    t0, s0 = (start["total_real_tokens"], start["total_train_s"]) if start and start is not end else (0, 0.0)
    secs = end["total_train_s"] - s0
    return {
        "tokens_per_s": (end["total_real_tokens"] - t0) / secs if secs > 0 else 0.0,
        "fill": end["total_real_tokens"] / end["total_padded_tokens"] if end["total_padded_tokens"] else 0.0,
        "peak_mem_mb": max(r["peak_mem_mb"] for r in rows),
        "final_loss": end["loss"],
        **({"eval_loss": evals[-1]["eval_loss"]} if (evals := read_jsonl(out_dir / RunDir.EVAL)) else {}),
    }


def run_trial(params: dict[str, Any], listing: tuple | None = None) -> None:
    """The Tune function: one short training run with these budget settings. ``listing``: the sweep's listing
    of the data (formats/units.read_units, made once in the driver: the settings swept leave it unchanged)."""
    from ray.tune.integration.ray_train import TuneReportCallback

    from ray_mmbatch.train.trainer import fit

    base = params["base"]
    cfg = apply_overrides(Config(), {f"{s}.{k}": v for s, sub in base.items() for k, v in sub.items()})
    setting = dict(params["setting"])
    apply_overrides(cfg, setting)
    name = "trial-" + "-".join(f"{k.split('.')[-1]}={v}" for k, v in sorted(setting.items()))
    out = Path(params["out_dir"]) / name
    cfg.train.output_dir = str(out)
    cfg.train.max_steps = params["warmup_steps"] + params["steps"]
    cfg.train.report_every = 1
    cfg.train.checkpoint_every = 0
    cfg.train.max_failures = 0
    import ray

    os.environ.update(params.get("tracker_env") or {})  # --report-to: W&B / MLflow settings of the sweep's shell
    ray.data.DataContext.get_current().enable_progress_bars = False  # a trial has no terminal to draw on
    result: dict[str, Any] = {"status": "ok", "error": ""}
    try:
        fit(cfg, run_name=name, callbacks=[TuneReportCallback()], reader=listing)
    except Exception as e:  # an OOM or crash makes this setting infeasible, not the sweep
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        result.update(status="oom" if "memory" in msg.lower() else "failed", error=msg[-500:])
    figures = _trial_metrics(out, params["warmup_steps"]) if (out / RunDir.METRICS).exists() else {}
    result.update({"tokens_per_s": 0.0, "fill": 0.0, "peak_mem_mb": 0.0, "final_loss": float("nan"),
                   "eval_loss": float("nan"), **figures})
    tune.report(judge(result, params["memory_limit_mb"]))


def judge(result: dict[str, Any], memory_limit_mb: float) -> dict[str, Any]:
    """A finished trial's result, judged: a run that went fine but peaked above ``memory_limit_mb`` is
    ``over_memory``; only an ``ok`` one is feasible, and its score is its tokens/s (else -1)."""
    if result["status"] == "ok" and result["peak_mem_mb"] > memory_limit_mb:
        result["status"] = "over_memory"
    result["feasible"] = result["status"] == "ok"
    result["score"] = result["tokens_per_s"] if result["feasible"] else -1.0
    return result


class _TrialLines(tune.Callback):
    """One console line per finished trial (the quiet console's stand-in for Tune's status tables)."""

    def __init__(self, total: int):
        self.total, self.done = total, 0

    def on_trial_result(self, iteration, trials, trial, result, **info):
        if "status" not in result:  # the per-step reports the Train callback forwards
            return
        self.done += 1
        s = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in trial.config["setting"].items())
        print(f"[tune] trial {self.done}/{self.total} {s}: {result.get('tokens_per_s', 0):,.0f} tok/s, "
              f"peak {result.get('peak_mem_mb', 0):,.0f} MB, fill {result.get('fill', 0):.3f}, {result['status']}",
              flush=True)


METRICS = {"tokens_per_s": max, "eval_loss": min, "final_loss": min}  # what --metric ranks by, and which way


def pick_best(trials: list[dict[str, Any]], metric: str = "tokens_per_s") -> dict[str, Any] | None:
    """The best feasible trial by ``metric`` (most tokens/s, least eval or final loss); None if none scored."""
    scored = [t for t in trials if t.get("feasible") and t.get(metric) is not None and t[metric] == t[metric]]
    return METRICS[metric](scored, key=lambda t: t[metric]) if scored else None  # (NaN != NaN: not scored)


#: what a trial's trackers read from the environment (run/trackers.py), passed from the sweep's process
TRACKER_ENV_PREFIXES = ("WANDB_", "MLFLOW_")
SECRET_WORDS = ("KEY", "TOKEN", "PASSWORD", "SECRET")


def tracker_env(sweep: str) -> dict[str, str]:
    """The W&B / MLflow settings of this process for the trials, which run in Ray workers that may
    have been started from another shell (``ray start``). Credentials (``WANDB_API_KEY``,
    ``MLFLOW_TRACKING_TOKEN``, ...) are left out: the trial's params are written to disk by Tune;
    they must be set where the cluster runs (``ray start``'s shell or the job's runtime_env).
    W&B runs of one sweep share a group (``WANDB_RUN_GROUP``, default: the sweep folder's name)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(TRACKER_ENV_PREFIXES)
           and not any(w in k for w in SECRET_WORDS)}
    env.setdefault("WANDB_RUN_GROUP", sweep)
    return env


def tune_budgets(base: Config, settings: list[dict[str, Any]], out_dir: str, memory_limit_mb: float,
                 warmup_steps: int = 2, steps: int = 4, verbose: bool = True,
                 metric: str = "tokens_per_s") -> dict[str, Any]:
    """One trial per setting; return {"trials": [...], "best": trial or None, "best_config": Config}.

    ``metric``: what picks the best feasible trial (METRICS; eval_loss needs --eval-split or
    --eval-data). ``verbose=False``: one line per trial instead of Tune's status tables."""
    if metric not in METRICS:
        raise ValueError(f"metric must be one of {sorted(METRICS)}, got {metric!r}")
    if metric == "eval_loss" and not (base.data.eval_split or base.data.eval_data):
        raise ValueError("--metric eval_loss needs a held-out set: --eval-split F or --eval-data PATH")
    from ray_mmbatch.train.trainer import connect

    connect()
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    base_dict = base.to_dict()
    base_dict["image"]["allowed_formats"] = list(base_dict["image"]["allowed_formats"])
    param_space = {"setting": tune.grid_search(list(settings))}
    param_space.update(base=base_dict, out_dir=str(out), memory_limit_mb=memory_limit_mb,
                       warmup_steps=warmup_steps, steps=steps, tracker_env=tracker_env(out.name))
    if not verbose:  # Tune's classic reporter at verbosity 0 prints nothing (the new one prints its header)
        os.environ["RAY_AIR_NEW_OUTPUT"] = "0"
    from ray_mmbatch.formats.units import read_units

    # one listing for the sweep (its settings are budgets, never data settings), handed to every trial
    # through the object store: a trial lists nothing (formats/listing.py)
    listing = read_units(base.data.path, base.data)
    tuner = tune.Tuner(
        tune.with_resources(tune.with_parameters(run_trial, listing=listing), {"cpu": 0.1}),  # it waits on its trainer
        param_space=param_space,
        # no metric here: the Train callback streams per-step reports; the best is picked from final results
        tune_config=tune.TuneConfig(max_concurrent_trials=1),
        run_config=tune.RunConfig(name="tune", storage_path=str(out / "ray_storage"),
                                  verbose=None if verbose else 0,
                                  callbacks=None if verbose else [_TrialLines(len(settings))]),
    )
    grid = tuner.fit()
    trials = []
    for r in grid:
        m = r.metrics or {}
        setting = r.config["setting"]
        trials.append({"setting": setting, **{k: m.get(k) for k in
                       ("tokens_per_s", "peak_mem_mb", "fill", "final_loss", "eval_loss", "status", "feasible",
                        "error")}})
        if m.get("status") is None:  # the function itself died before reporting
            trials[-1].update(status="failed", feasible=False, error=str(r.error)[-500:])
    best = pick_best(trials, metric)
    best_cfg = copy.deepcopy(base)
    if best:
        apply_overrides(best_cfg, best["setting"])
        save_config(best_cfg, out / "best.yaml")
    (out / "trials.json").write_text(json.dumps({"trials": trials, "best": best}, indent=2, default=str))
    return {"trials": trials, "best": best, "best_config": best_cfg}


def format_table(trials: list[dict[str, Any]]) -> str:
    head = f"{'setting':<48} {'tokens/s':>10} {'peak MB':>9} {'fill':>6}  status"
    lines = [head, "-" * len(head)]
    for t in sorted(trials, key=lambda t: -(t["tokens_per_s"] or 0)):
        s = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in t["setting"].items())
        lines.append(f"{s:<48} {t['tokens_per_s'] or 0:>10.0f} {t['peak_mem_mb'] or 0:>9.0f} "
                     f"{t['fill'] or 0:>6.3f}  {t['status']}")
    return "\n".join(lines)
