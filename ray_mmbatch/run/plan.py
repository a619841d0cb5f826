"""A run's plan, stated before it starts and kept in summary.json: samples, epochs, steps, learning rate, tokens.

``make_plan(cfg, samples_per_epoch, tokens_per_sample)`` turns the resolved config (run/defaults.py) and two
counts into a dict; ``plan_lines(plan)`` says it in the run's first lines. The samples are the up-front count
(formats/units.py ``count_samples``: Parquet footers, the LLaVA record list, tar headers) less the held-out
share. The steps of an epoch are not known before the batches are planned, so they are an estimate, and
said to be one: the mean tokens of the samples the pre-flight measured (run/preflight.py) against the tokens
one optimizer step takes at full batches (--max-tokens x --grad-accum x --num-workers; pack mode fills
batches to ~95-99 %, pad mode less, so a run takes that many steps or more). A run that goes by epochs
does not depend on the estimate: its schedule follows the share of the samples done (train/step.py).
Pure module: no ray, no torch.
"""
from __future__ import annotations

import math
from typing import Any

from ray_mmbatch.config import Config
from ray_mmbatch.run.defaults import mode

LR_FLOOR = 0.1  # the cosine ends at this share of the peak (train/step.py lr_by_progress)


def steps_per_epoch_estimate(cfg: Config, samples_per_epoch: int, tokens_per_sample: float) -> int:
    """Optimizer steps one epoch takes at full batches: samples over (samples per batch x grad_accum x workers)."""
    per_batch = cfg.budget.max_tokens / max(tokens_per_sample, 1.0)
    if cfg.budget.max_samples:
        per_batch = min(per_batch, cfg.budget.max_samples)
    per_step = max(per_batch, 1.0) * cfg.train.grad_accum * cfg.train.num_workers
    return max(1, math.ceil(samples_per_epoch / per_step))


def make_plan(cfg: Config, samples_per_epoch: int | None, tokens_per_sample: float | None = None,
              sampled: int = 0) -> dict[str, Any]:
    """The plan of a run of the resolved ``cfg``: summary.json's ``plan``.

    ``samples_per_epoch``: the up-front count less the held-out share (None: not counted);
    ``tokens_per_sample``: the mean LM tokens of the ``sampled`` samples the pre-flight measured (None: no
    estimate). They are the first ones in listing order: a dataset ordered by source or length makes the
    estimate rough (the synthetic demo data: a mean of 279 over the first 64 samples, 431 over all 1,000)."""
    t = cfg.train
    epochs = max(1, t.epochs)
    steps = None
    if samples_per_epoch and tokens_per_sample:
        steps = steps_per_epoch_estimate(cfg, samples_per_epoch, tokens_per_sample)
    if t.max_steps:
        warmup = t.warmup_steps or math.ceil((t.warmup_ratio or 0.0) * t.max_steps)
        length = f"cosine decay to {t.lr * LR_FLOOR:.3g} at step {t.max_steps}"
    else:
        warmup = t.warmup_steps or 0
        length = f"cosine decay to {t.lr * LR_FLOOR:.3g} at the end, following the share of the samples done"
    if warmup:
        warm = f"linear warm-up over {warmup} steps"
    elif t.warmup_ratio:
        warm = f"linear warm-up over the first {t.warmup_ratio:.0%} of the " + \
            ("steps" if t.max_steps else "samples")
    else:
        warm = "no warm-up"
    every = float(t.checkpoint_every or 0)
    checkpoints = (f"every {int(every)} steps and at the end" if every >= 1 else
                   f"every {every:.0%} of the run and at the end" if every > 0 else "at the end only")
    return {
        "mode": mode(cfg),
        "samples_per_epoch": samples_per_epoch,
        "epochs": epochs,
        "max_steps": t.max_steps,
        "steps_per_epoch_estimate": steps,
        "tokens_per_sample_estimate": round(tokens_per_sample, 1) if tokens_per_sample else None,
        "tokens_per_sample_from": sampled if tokens_per_sample else 0,
        "tokens_per_step": cfg.budget.max_tokens * t.grad_accum * t.num_workers,
        "lr": t.lr,
        "lr_end": t.lr * LR_FLOOR,
        "warmup_steps": warmup,
        "warmup_ratio": t.warmup_ratio if not warmup else 0.0,
        "schedule": f"{warm}, then {length}",
        "checkpoints": checkpoints,
        "output_dir": t.output_dir,
        "defaults_from": dict(t.defaults_from),
    }


def plan_lines(plan: dict[str, Any], cfg: Config) -> list[str]:
    """The run's first lines: what it will train, how long, at what learning rate, with how many tokens a step."""
    n, epochs, steps = plan["samples_per_epoch"], plan["epochs"], plan["steps_per_epoch_estimate"]
    samples = f"{n:,} samples per epoch (counted up front)" if n is not None else "samples not counted up front"
    length = f"{epochs} epoch{'s' if epochs > 1 else ''}"
    if plan["max_steps"]:
        length = f"{plan['max_steps']} optimizer steps (--max-steps; or the end of {length}, if sooner)"
    lines = [f"plan ({plan['mode']}): {samples} x {length}"]
    if steps:
        lines.append(f"plan: about {steps:,} optimizer steps per epoch ({steps * epochs:,} in {epochs}), an estimate: "
                     f"{plan['tokens_per_sample_estimate']:g} tokens per sample (mean of the first "
                     f"{plan['tokens_per_sample_from'] or ''} samples read, in listing order) at full batches")
    lines.append(f"plan: learning rate {plan['lr']:.3g} ({_source(plan, 'lr')}), {plan['schedule']}")
    lines.append(f"plan: at most {plan['tokens_per_step']:,} tokens per optimizer step (--max-tokens "
                 f"{cfg.budget.max_tokens} x --grad-accum {cfg.train.grad_accum} x --num-workers "
                 f"{cfg.train.num_workers}); checkpoints {plan['checkpoints']}")
    return lines


def _source(plan: dict[str, Any], name: str) -> str:
    return plan["defaults_from"].get(name, "set by you")
